"""A model directory with a broken `config.json`: one line naming the file and the problem,
from `LLM` (a `ConfigError`, which is a ValueError) and from `tandem generate` (exit 2),
never a traceback from transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tandem.cli import main as cli_main
from tandem.schema.config import ConfigError


def _copy_with_config(source: Path, target: Path, text: str) -> Path:
    shutil.copytree(source, target)
    (target / "config.json").write_text(text)
    return target


def _valid_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda text, cfg: text.replace('"hidden_size": 64,', '"hidden_size": 64', 1),
            r"config\.json:\d+:\d+: not valid JSON",
        ),
        (lambda text, cfg: "[1, 2]", r"config\.json: expected a JSON object, got a list"),
        (
            lambda text, cfg: json.dumps({k: v for k, v in cfg.items() if k != "model_type"}),
            r"config\.json: no model_type; supported: ",
        ),
        (
            lambda text, cfg: json.dumps(cfg | {"model_type": "gpt2"}),
            r"config\.json: model_type 'gpt2'; supported: ",
        ),
        (
            lambda text, cfg: json.dumps(cfg | {"num_hidden_layers": "two"}),
            r"config\.json: .*num_hidden_layers",
        ),
        (lambda text, cfg: "", r"config\.json:1:1: not valid JSON"),
    ],
    ids=["syntax", "not-an-object", "no-model-type", "unsupported", "bad-field", "empty"],
)
def test_llm_names_the_file_and_the_problem(
    tiny_llama_dir: Path, tmp_path: Path, mutate, expected: str
) -> None:
    from tandem import LLM

    text = (tiny_llama_dir / "config.json").read_text()
    model_dir = _copy_with_config(
        tiny_llama_dir, tmp_path / "model", mutate(text, _valid_config(tiny_llama_dir))
    )
    with pytest.raises(ConfigError, match=expected) as info:
        LLM(model=str(model_dir), num_kv_blocks=64, max_model_len=64)
    message = str(info.value)
    assert str(model_dir / "config.json") in message
    assert "\n" not in message


def test_generate_exits_2_with_one_line(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        (tiny_llama_dir / "config.json").read_text().replace('"architectures"', "architectures", 1)
    )
    model_dir = _copy_with_config(tiny_llama_dir, tmp_path / "model", text)
    code = cli_main(["generate", "--token-ids", "1 2 3", "--model", str(model_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("tandem: error: model.model: ") and "config.json:" in err[0]
    assert "Traceback" not in err[0]
