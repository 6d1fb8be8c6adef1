"""`tandem bench --accuracy`: teacher-forced top-1 agreement with the float model and
perplexity per quantization, written as JSON (`tandem.accuracy`, shared with
`benchmarks/quant_accuracy.py`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tandem.accuracy import ACCURACY_TEXT, quantization_settings
from tandem.cli import main as cli_main
from tandem.testing.tiny_model import WORDS, save_tiny_model, save_tiny_tokenizer

#: Measured on the tiny Llama (random weights of std 1, so logits far larger than a trained
#: model's) and the text below, 195 positions: int8 in groups of 32 agreed on 93.3 %, int4
#: (groups of 32) on 38.5 %. The bounds sit a few positions below.
INT8_MIN_AGREEMENT = 0.90
INT4_MIN_AGREEMENT = 0.30


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("accuracy") / "llama"
    save_tiny_model("llama", directory)
    save_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def word_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 words of the tiny tokenizer's vocabulary (each one token)."""
    rng = random.Random(7)
    vocabulary = WORDS + [f"w{i}" for i in range(20, 300)]
    path = tmp_path_factory.mktemp("text") / "words.txt"
    path.write_text(" ".join(rng.choice(vocabulary) for _ in range(200)))
    return path


def test_accuracy_reports_agreement_and_perplexity_per_quantization(
    tiny_chat_model: Path, word_text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "accuracy.json"
    argv = ["bench", "--accuracy", "--model", str(tiny_chat_model), "--text", str(word_text)]
    argv += ["--quantizations", "none,auto,int8,int4", "--chunk", "48", "--threads", "1"]
    assert cli_main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["baseline"] == "none" and report["chunk_tokens"] == 48
    assert report["text"] == str(word_text) and report["text_tokens"] == 200
    results = report["results"]
    assert list(results) == ["none", "auto", "int8", "int4"]
    for name, result in results.items():
        assert set(result) == {
            "quantization",
            "top1_agreement",
            "perplexity",
            "perplexity_ratio",
            "positions",
        }, name
        assert result["positions"] == 200 - 5  # 5 chunks; each chunk's first token unscored
        assert result["perplexity"] > 1
    none, auto = results["none"], results["auto"]
    assert none["top1_agreement"] == 1.0 and none["perplexity_ratio"] == 1.0
    assert none["quantization"] == "none" and auto["quantization"] == "none"  # a float model
    assert auto["top1_agreement"] == 1.0
    assert results["int8"]["quantization"] == "int8"
    assert results["int8"]["top1_agreement"] >= INT8_MIN_AGREEMENT
    assert results["int4"]["top1_agreement"] >= INT4_MIN_AGREEMENT
    int8, int4 = results["int8"], results["int4"]
    assert int8["top1_agreement"] > int4["top1_agreement"]  # more bits, closer to float
    assert 1 < int8["perplexity_ratio"] < int4["perplexity_ratio"]
    printed = capsys.readouterr().out
    assert "int4" in printed and "top-1 agreement" in printed


def test_a_bad_quantization_name_is_refused_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "accuracy.json"
    argv = ["bench", "accuracy", "--model", "/nonexistent", "--quantizations", "none,int3"]
    assert cli_main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--quantizations: 'int3' is not a quantization" in err
    assert not out.exists()


def test_quantization_names_map_to_the_config_keys() -> None:
    assert quantization_settings("none") == {"quantization": "none"}
    assert quantization_settings("awq") == {"quantization": "awq"}
    assert quantization_settings("int4-g64") == {
        "quantization": "int4",
        "quantization_group_size": 64,
    }
    assert quantization_settings("int8-g0")["quantization_group_size"] == 0
    for bad in ("int4-g0", "int8-g48", "auto-g32", "fp8"):
        with pytest.raises(ValueError, match="--quantizations"):
            quantization_settings(bad)


def test_the_fixed_text_is_found_in_a_checkout() -> None:
    assert ACCURACY_TEXT.is_file() and ACCURACY_TEXT.name == "accuracy_text.txt"
