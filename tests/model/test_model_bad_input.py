"""Bad models and bad inputs fail early with a message that names what is wrong.

Model resolution (missing path, unsupported GGUF architecture, corrupt GGUF, directory
without config.json, unsupported model type), and request-level errors (chat messages
without a role, text prompts without a tokenizer, ids outside the vocabulary, prompts that
are too long). After a rejected call the engine is idle and keeps working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tandem.llm import LLM
from tandem.schema.config import ConfigError
from tandem.schema.sampling_params import SamplingParams


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private $TANDEM_CACHE, so a GGUF test never writes into the user's cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TANDEM_CACHE", str(cache))
    return cache


def write_gguf(path: Path, arch: str) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name("tiny-unsupported")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_llm(model_dir: Path, **overrides: Any) -> LLM:
    settings: dict[str, Any] = {
        "max_model_len": 64,
        "num_kv_blocks": 64,
        "block_size": 4,
        "check_invariants": True,
    }
    settings.update(overrides)
    return LLM(model=str(model_dir), **settings)


# Model resolution -----------------------------------------------------------------------
def test_missing_model_path_names_field_and_path() -> None:
    with pytest.raises(ValueError) as info:
        LLM(model="/no/such/dir")
    assert isinstance(info.value, ConfigError)
    assert "model.model" in str(info.value)
    assert "/no/such/dir" in str(info.value)


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_gguf_of_unsupported_architecture(tmp_path: Path, isolated_cache: Path, arch: str) -> None:
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch)
    with pytest.raises(ConfigError) as info:
        LLM(model=str(path))
    message = str(info.value)
    assert "model.model" in message
    assert repr(arch) in message or arch in message
    assert str(path) in message
    assert "llama" in message  # says what is supported
    # Nothing was converted or left behind in the cache.
    assert not isolated_cache.exists() or not any(isolated_cache.iterdir())


def test_corrupt_gguf_names_field_and_path(tmp_path: Path, isolated_cache: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a GGUF file" * 8)
    with pytest.raises(ValueError) as info:
        LLM(model=str(path))
    message = str(info.value)
    assert isinstance(info.value, ConfigError), f"{type(info.value).__name__}: {message}"
    assert "model.model" in message and str(path) in message, message


def test_directory_without_config_json(tmp_path: Path) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "README.md").write_text("nothing here")
    with pytest.raises(ConfigError) as info:
        LLM(model=str(empty))
    message = str(info.value)
    assert "model.model" in message and str(empty) in message and "config.json" in message


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ConfigError) as info:
        LLM(model=str(path))
    assert "model.model" in str(info.value) and str(path) in str(info.value)


def test_hf_directory_of_unsupported_model_type(tmp_path: Path) -> None:
    from transformers import GPT2Config

    target = tmp_path / "gpt2"
    GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=16, bos_token_id=0, eos_token_id=0
    ).save_pretrained(target)
    with pytest.raises(ConfigError) as info:
        LLM(model=str(target))
    message = str(info.value)
    assert "model.model" in message and "gpt2" in message and str(target) in message


def test_unknown_engine_option_is_named(tiny_models) -> None:
    with pytest.raises(ConfigError) as info:
        LLM(model=str(tiny_models["llama"]), max_num_seq=4)
    assert "max_num_seq" in str(info.value)


def test_kv_pool_smaller_than_max_model_len(tiny_models) -> None:
    with pytest.raises(ConfigError) as info:
        tiny_llm(tiny_models["llama"], num_kv_blocks=8, block_size=4, max_model_len=64)
    assert "num_kv_blocks" in str(info.value)


# Requests -------------------------------------------------------------------------------
def test_chat_message_without_role(smollm2_llm) -> None:
    llm = smollm2_llm
    with pytest.raises(ValueError) as info:
        llm.chat([{"content": "hi"}])
    assert "role" in str(info.value)
    with pytest.raises(ValueError) as info:
        llm.chat([{"role": "user"}])
    assert "content" in str(info.value)
    with pytest.raises(ValueError) as info:  # the second conversation is the bad one
        llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "text": "b"}]])
    assert "messages[1][0]" in str(info.value)
    assert not llm.engine.has_work()
    assert not llm.output_processor.records
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) <= 2


def test_text_prompt_without_tokenizer(tiny_models) -> None:
    llm = tiny_llm(tiny_models["qwen3"])
    assert llm.tokenizer is None
    with pytest.raises(ValueError) as info:
        llm.generate("hello there")
    assert "tokenizer" in str(info.value)
    with pytest.raises(ValueError) as info:
        llm.generate({"prompt": "hello there"})
    assert "tokenizer" in str(info.value)
    with pytest.raises(ValueError) as info:
        llm.chat([{"role": "user", "content": "hi"}])
    assert "tokenizer" in str(info.value)


def test_bad_prompt_in_a_batch_leaves_engine_usable(tiny_models) -> None:
    llm = tiny_llm(tiny_models["qwen3"])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    good = [5, 6, 7, 8]
    reference = llm.generate([good], params)[0].outputs[0].token_ids
    for bad in ("text prompt", [5, 6, 99_999], [-1, 4], []):
        with pytest.raises(ValueError):
            llm.generate([good, bad, good], params)
        assert not llm.engine.has_work()
        assert not llm.output_processor.records
    again = llm.generate([good, good], params)
    assert [o.outputs[0].token_ids for o in again] == [reference, reference]


def test_token_ids_outside_vocabulary(tiny_models) -> None:
    llm = tiny_llm(tiny_models["llama"])
    vocab = llm.config.model.vocab_size
    with pytest.raises(ValueError) as info:
        llm.generate([[1, 2, vocab]])
    message = str(info.value)
    assert "prompt_token_ids" in message and str(vocab) in message


def test_prompt_too_long(tiny_models) -> None:
    llm = tiny_llm(tiny_models["llama"], max_model_len=32, num_kv_blocks=16)
    with pytest.raises(ValueError) as info:
        llm.generate([[5] * 32])
    assert "max_model_len" in str(info.value)
    out = llm.generate([[5] * 31], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 1  # one position left
    assert out[0].outputs[0].finish_reason == "length"
