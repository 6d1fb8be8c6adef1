"""Default sampling parameters come from the model's generation_config.json, as vLLM's
`generation_config="auto"`: temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens (as max_tokens) apply when the caller passes no SamplingParams. The embedded
SmolLM2 (a GGUF with none) gets sensible ones written beside its converted weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.models.model_files import (
    EMBEDDED_DEFAULTS_MARKER,
    EMBEDDED_DEFAULTS_VERSION,
    ensure_embedded_generation_config,
    generation_defaults,
)
from tandem.schema.config import ConfigError

SMALL = {"max_model_len": 64, "num_kv_blocks": 64, "block_size": 4}
PROMPTS = [[5, 6, 7, 8], [9, 10]]


def model_with_generation_config(source: Path, target: Path, values: dict[str, Any]) -> Path:
    shutil.copytree(source, target)
    path = target / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(values)
    path.write_text(json.dumps(config))
    return target


def test_generation_config_sets_the_defaults(tiny_chat_model: Path, tmp_path: Path) -> None:
    values = {"temperature": 0.0, "max_new_tokens": 3, "top_k": 7, "repetition_penalty": 1.2}
    model = model_with_generation_config(tiny_chat_model, tmp_path / "m", values)
    llm = LLM(model=str(model), **SMALL)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 3, 7)
    assert defaults.repetition_penalty == 1.2
    assert defaults.top_p == SamplingParams().top_p  # not in the file: SamplingParams' own
    explicit = SamplingParams(
        temperature=0.0, max_tokens=3, top_k=7, repetition_penalty=1.2, ignore_eos=True
    )
    expected = llm.generate(PROMPTS, explicit, use_tqdm=False)
    outs = llm.generate(PROMPTS, use_tqdm=False)  # before: temperature 1.0, 16 tokens
    for out, ref in zip(outs, expected, strict=True):
        assert len(out.outputs[0].token_ids) <= 3
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids[: len(out.outputs[0].token_ids)]


def test_given_sampling_params_replace_the_defaults(tiny_chat_model: Path, tmp_path: Path) -> None:
    model = model_with_generation_config(
        tiny_chat_model, tmp_path / "m", {"temperature": 0.0, "max_new_tokens": 2}
    )
    llm = LLM(model=str(model), **SMALL)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


def test_chat_uses_the_defaults(tiny_chat_model: Path, tmp_path: Path) -> None:
    model = model_with_generation_config(
        tiny_chat_model, tmp_path / "m", {"temperature": 0.0, "max_new_tokens": 2}
    )
    llm = LLM(model=str(model), **SMALL)
    out = llm.chat([{"role": "user", "content": "hello"}], use_tqdm=False)
    assert 1 <= len(out[0].outputs[0].token_ids) <= 2


def test_generation_config_vllm_ignores_the_file(tiny_chat_model: Path, tmp_path: Path) -> None:
    model = model_with_generation_config(
        tiny_chat_model, tmp_path / "m", {"temperature": 0.0, "max_new_tokens": 2}
    )
    llm = LLM(model=str(model), generation_config="vllm", **SMALL)
    assert llm.get_default_sampling_params() == SamplingParams()


def test_generation_config_from_another_directory(tiny_chat_model: Path, tmp_path: Path) -> None:
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "min_p": 0.1}))
    llm = LLM(model=str(tiny_chat_model), generation_config=str(other), **SMALL)
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_p, defaults.min_p, defaults.temperature) == (0.5, 0.1, 1.0)
    with pytest.raises(ConfigError, match="model.generation_config: '/no/such'"):
        LLM(model=str(tiny_chat_model), generation_config="/no/such", **SMALL)


def test_model_without_sampling_defaults_keeps_sampling_params_defaults(
    tiny_chat_model: Path,
) -> None:
    llm = LLM(model=str(tiny_chat_model), **SMALL)
    assert llm.get_default_sampling_params() == SamplingParams()


def test_invalid_generation_config_names_the_file_and_field(
    tiny_chat_model: Path, tmp_path: Path
) -> None:
    model = model_with_generation_config(tiny_chat_model, tmp_path / "m", {"top_p": 1.5})
    with pytest.raises(ConfigError) as info:
        LLM(model=str(model), **SMALL)
    message = str(info.value)
    assert message.startswith("model.generation_config: ")
    assert "generation_config.json: top_p" in message


def test_null_values_and_unrelated_keys_are_not_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": None, "top_p": 0.8, "eos_token_id": 2, "do_sample": True})
    )
    assert generation_defaults(tmp_path) == {"top_p": 0.8}
    assert generation_defaults(tmp_path / "missing") == {}


# The embedded model's defaults ------------------------------------------------------------
def test_embedded_defaults_are_written_when_missing(tmp_path: Path) -> None:
    """A cache converted before the defaults existed gets them on the next start."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    ensure_embedded_generation_config(tmp_path)
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written["eos_token_id"] == 2
    assert written[EMBEDDED_DEFAULTS_MARKER] == EMBEDDED_DEFAULTS_VERSION
    assert generation_defaults(tmp_path) == {"temperature": 0.0, "max_tokens": 256}
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    ensure_embedded_generation_config(fresh)  # no file at all
    assert generation_defaults(fresh) == generation_defaults(tmp_path)


def test_embedded_defaults_never_overwrite_someone_elses(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.7}))
    ensure_embedded_generation_config(tmp_path)
    assert json.loads(path.read_text()) == {"temperature": 0.7}


def test_embedded_defaults_of_an_older_version_are_replaced(tmp_path: Path) -> None:
    path = tmp_path / "generation_config.json"
    old = {"do_sample": True, "top_p": 0.9, "temperature": 0.2, EMBEDDED_DEFAULTS_MARKER: 0}
    path.write_text(json.dumps({**old, "eos_token_id": 2}))
    ensure_embedded_generation_config(tmp_path)
    written = json.loads(path.read_text())
    assert "top_p" not in written
    assert written["eos_token_id"] == 2
    assert generation_defaults(tmp_path) == {"temperature": 0.0, "max_tokens": 256}


def test_default_model_answers_the_readme_chat_sensibly() -> None:
    """The README's `llm.chat([...])`: before, temperature 1.0 and 16 tokens gave a cut
    sentence of nonsense."""
    llm = LLM(num_kv_blocks=64, block_size=16, max_model_len=1024)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 256)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
    llm.shutdown()
