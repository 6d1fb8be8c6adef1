"""What a start prints: one notice before the first (minute-long) conversion of the embedded
model, and no transformers progress bar per load on a warm start."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.models import model_files


class _StopConversion(RuntimeError):
    pass


def _refuse(*args: object, **kwargs: object) -> None:
    raise _StopConversion


def test_first_start_announces_the_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the converted cache missing, the notice comes before transformers' own work (here
    stopped at its first call, so the test converts nothing)."""
    import transformers

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", _refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _refuse)
    with pytest.raises(_StopConversion):
        model_files.resolve_model_dir("default")
    err = capsys.readouterr().err
    assert "converting the embedded model once (about a minute)" in err
    assert str(tmp_path / "cache") in err


def test_warm_start_says_nothing_about_conversion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    target = model_files.gguf_cache_dir(model_files.embedded_gguf_path())
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    assert model_files.convert_gguf(model_files.embedded_gguf_path()) == target
    assert "converting" not in capsys.readouterr().err


def test_loading_shows_no_progress_bars_and_restores_them(
    tiny_llama_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from transformers.utils import logging as hf_logging

    from tandem import LLM

    assert hf_logging.is_progress_bar_enabled()
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=32, max_model_len=64)
    llm.engine.shutdown()
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err
    assert hf_logging.is_progress_bar_enabled(), "the caller's progress-bar setting is restored"


def test_quiet_loading_keeps_bars_off_when_the_caller_turned_them_off() -> None:
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        with model_files.quiet_loading():
            assert not hf_logging.is_progress_bar_enabled()
        assert not hf_logging.is_progress_bar_enabled()
        assert hub_utils.are_progress_bars_disabled()
    finally:
        hf_logging.enable_progress_bar()
