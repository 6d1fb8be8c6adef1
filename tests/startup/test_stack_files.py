"""Stack files: a key written twice is an error naming the file, the line and the key; string
values expand environment variables, and `${TANDEM_CACHE}` always resolves (the bundled
EAGLE stacks find their head wherever the cache is)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.schema.cache_dir import cache_root
from tandem.schema.config import ConfigError
from tandem.stack_file import load_config

STACKS = Path(__file__).resolve().parents[2] / "examples" / "stacks"


def _stack(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return path


def test_duplicate_key_names_file_line_and_key(tmp_path: Path) -> None:
    path = _stack(
        tmp_path,
        "model:\n  model: scripted\nscheduler:\n  max_num_seqs: 4\n  max_num_seqs: 8\n",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}:5: duplicate key 'max_num_seqs' (first written on line 4)")
    assert "\n" not in message


def test_duplicate_section_is_refused(tmp_path: Path) -> None:
    path = _stack(tmp_path, "cache:\n  block_size: 4\nmodel: {model: scripted}\ncache: {}\n")
    with pytest.raises(ConfigError, match=r"stack\.yaml:4: duplicate key 'cache'"):
        load_config(path)


def test_merge_keys_and_distinct_keys_are_fine(tmp_path: Path) -> None:
    path = _stack(
        tmp_path,
        "model: &m {model: scripted, max_model_len: 64}\n"
        "scheduler: {max_num_seqs: 4, max_num_batched_tokens: 32}\n",
    )
    config = load_config(path)
    assert config.scheduler.max_num_seqs == 4 and config.model.max_model_len == 64


def test_environment_variables_expand_with_line_on_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_TEST_MODEL", "scripted")
    monkeypatch.delenv("TANDEM_TEST_UNSET", raising=False)
    path = _stack(
        tmp_path, "model:\n  model: ${TANDEM_TEST_MODEL}\n  tokenizer: ${TANDEM_TEST_UNSET:-none}\n"
    )
    config = load_config(path)
    assert config.model.model == "scripted" and config.model.tokenizer == "none"
    path = _stack(tmp_path, "model:\n  model: scripted\n  tokenizer: ${TANDEM_TEST_UNSET}/tok\n")
    with pytest.raises(
        ConfigError,
        match=r"stack\.yaml:3: model\.tokenizer: environment variable TANDEM_TEST_UNSET is not set",
    ):
        load_config(path)


@pytest.mark.parametrize("stack", ["eagle-sync.yaml", "eagle-async.yaml"])
def test_eagle_stacks_follow_tandem_cache(
    stack: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    config = load_config(STACKS / stack)
    assert config.speculative is not None
    assert config.speculative.model == f"{tmp_path / 'cache'}/eagle/smollm2-135m-instruct"
    monkeypatch.delenv("TANDEM_CACHE")
    config = load_config(STACKS / stack)
    assert (
        config.speculative.model
        == f"{Path.home() / '.cache' / 'tandem'}/eagle/smollm2-135m-instruct"
    )
    assert Path(config.speculative.model).parent.parent == cache_root()


def test_every_example_stack_still_loads() -> None:
    for stack in sorted(STACKS.glob("*.yaml")):
        load_config(stack)
