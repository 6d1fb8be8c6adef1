"""`LLM("org/name")`: a Hugging Face hub id is read from the local hub cache; nothing is
downloaded unless the user opts in (`allow_download=True`, `tandem ... --download`), and
otherwise the error names the id and the opt-in. The cache is built in a temp directory;
downloads are replaced by a stand-in, so nothing touches the network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from frontdoor_helpers import HUB_ID, write_hub_snapshot

from tandem import LLM, SamplingParams
from tandem.cli import main as cli_main
from tandem.schema.config import ConfigError

SMALL = {"max_model_len": 64, "num_kv_blocks": 64, "block_size": 4}
GREEDY = SamplingParams(temperature=0, max_tokens=4)


class RecordingSnapshotDownload:
    """Stands in for `huggingface_hub.snapshot_download`: records each call; a call that
    may download "fetches" the repository by copying `source` into the cache."""

    def __init__(self, cache: Path, source: Path) -> None:
        self.cache = cache
        self.source = source
        self.real = huggingface_hub.snapshot_download
        self.calls: list[dict[str, Any]] = []

    def __call__(self, repo_id: str, **kwargs: Any) -> str:
        self.calls.append({"repo_id": repo_id, **kwargs})
        if kwargs.get("local_files_only"):
            return self.real(repo_id, **kwargs)
        return str(write_hub_snapshot(self.cache, repo_id, self.source))

    @property
    def downloads(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if not c.get("local_files_only")]


@pytest.fixture
def recorder(
    hub_cache: tuple[Path, Path], tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch
) -> RecordingSnapshotDownload:
    rec = RecordingSnapshotDownload(hub_cache[0], tiny_chat_model)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", rec)
    return rec


def test_hub_id_resolves_to_the_cached_snapshot(
    hub_cache: tuple[Path, Path], recorder: RecordingSnapshotDownload
) -> None:
    _, snapshot = hub_cache
    llm = LLM(HUB_ID, **SMALL)
    assert Path(llm.config.model.model) == snapshot
    out = llm.generate(["hello world"], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == [7, 8]  # the cached tokenizer's ids
    assert len(out.outputs[0].token_ids) == 4
    assert out.outputs[0].text  # decoded by the cached tokenizer
    assert recorder.calls and not recorder.downloads


def test_missing_hub_id_names_the_id_and_the_opt_in(
    hub_cache: tuple[Path, Path], recorder: RecordingSnapshotDownload
) -> None:
    with pytest.raises(ConfigError) as info:
        LLM("tiny-org/not-cached", **SMALL)
    message = str(info.value)
    assert "model.model: 'tiny-org/not-cached'" in message
    assert "allow_download=True" in message and "--download" in message
    assert str(hub_cache[0]) in message  # where it looked
    assert not recorder.downloads  # nothing downloads by default


def test_partial_snapshot_counts_as_missing(
    hub_cache: tuple[Path, Path], recorder: RecordingSnapshotDownload, tmp_path: Path
) -> None:
    """A snapshot with only config.json (e.g. left by AutoConfig) is not a model."""
    cache, snapshot = hub_cache
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    shutil.copy(snapshot / "config.json", only_config / "config.json")
    write_hub_snapshot(cache, "tiny-org/config-only", only_config)
    with pytest.raises(ConfigError, match="only partly"):
        LLM("tiny-org/config-only", **SMALL)
    assert not recorder.downloads


def test_allow_download_fetches_a_missing_hub_id(
    hub_cache: tuple[Path, Path], recorder: RecordingSnapshotDownload
) -> None:
    llm = LLM("tiny-org/fresh", allow_download=True, **SMALL)
    (download,) = recorder.downloads
    assert download["repo_id"] == "tiny-org/fresh"
    assert "*.safetensors" in download["allow_patterns"]
    assert Path(llm.config.model.model).parent.parent.name == "models--tiny-org--fresh"
    assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4
    # Cached now: the next start reads the cache and downloads nothing more.
    LLM("tiny-org/fresh", allow_download=True, **SMALL)
    assert len(recorder.downloads) == 1


def test_failed_download_names_the_id(
    hub_cache: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = huggingface_hub.snapshot_download

    def offline(repo_id: str, **kwargs: Any) -> str:
        if kwargs.get("local_files_only"):
            return real(repo_id, **kwargs)
        raise OSError("no network here")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConfigError, match="downloading 'tiny-org/gone' failed: no network here"):
        LLM("tiny-org/gone", allow_download=True, **SMALL)


def test_an_existing_local_path_wins_over_the_hub(
    hub_cache: tuple[Path, Path],
    tiny_chat_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = tmp_path / "tiny-org" / "tiny-llama"
    shutil.copytree(tiny_chat_model, local)
    monkeypatch.chdir(tmp_path)
    llm = LLM(HUB_ID, **SMALL)
    assert Path(llm.config.model.model) == Path(HUB_ID)


def test_cli_download_flag_is_the_opt_in(
    hub_cache: tuple[Path, Path],
    recorder: RecordingSnapshotDownload,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["generate", "--model", "tiny-org/cli", "--max-tokens", "2", "--num-kv-blocks", "64"]
    argv += ["--block-size", "4", "--max-model-len", "64", "hello world"]
    assert cli_main(argv) == 2
    assert "--download" in capsys.readouterr().err
    assert not recorder.downloads
    assert cli_main([*argv, "--download"]) == 0
    assert len(recorder.downloads) == 1
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["prompt"] == "hello world" and len(line["token_ids"]) == 2
