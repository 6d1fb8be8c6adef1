"""`light_config` builds the Llama family's configs as `AutoConfig` does, without its imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.models.light_config import LIGHT_CONFIG_TYPES, light_config, reads_light
from tandem.models.model_files import SUPPORTED_MODEL_TYPES, load_hf_config, load_tokenizer

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "vocab_size": 96}

#: config.json variants: defaults, legacy rotary keys, generation keys, quantization, dtype.
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-defaults": {"model_type": "llama"},
    "llama-tiny": {"model_type": "llama", **TINY},
    "llama3-rope-legacy": {
        "model_type": "llama",
        **TINY,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
        "temperature": 0.6,
        "architectures": ["LlamaForCausalLM"],
    },
    "llama-linear-rope-head-dim": {
        "model_type": "llama",
        **TINY,
        "head_dim": 32,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "attention_bias": True,
        "mlp_bias": True,
    },
    "llama-gptq": {
        "model_type": "llama",
        **TINY,
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32},
    },
    "mistral-defaults": {"model_type": "mistral"},
    "mistral-no-window": {"model_type": "mistral", **TINY, "sliding_window": None},
    "qwen2-defaults": {"model_type": "qwen2"},
    "qwen2-window": {
        "model_type": "qwen2",
        **TINY,
        "use_sliding_window": True,
        "sliding_window": 16,
        "max_window_layers": 1,
        "rope_theta": 1000000.0,
        "dtype": "float32",
    },
    "qwen3-defaults": {"model_type": "qwen3"},
    "qwen3-yarn": {
        "model_type": "qwen3",
        **TINY,
        "head_dim": 24,
        "attention_bias": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
        },
    },
}


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_light_config_equals_autoconfig(tmp_path: Path, name: str) -> None:
    from transformers import AutoConfig

    model_dir = _write(tmp_path, CONFIGS[name])
    want = AutoConfig.from_pretrained(str(model_dir))
    got = light_config(model_dir, CONFIGS[name]["model_type"])
    assert got.model_type == want.model_type
    assert got.to_dict() == want.to_dict()
    for key in ("head_dim", "num_key_value_heads", "rope_parameters", "dtype", "sliding_window"):
        assert getattr(got, key, None) == getattr(want, key, None), key


def test_every_supported_model_type_has_a_light_config() -> None:
    assert SUPPORTED_MODEL_TYPES == LIGHT_CONFIG_TYPES


def test_a_mistral_config_with_layer_types_is_left_to_autoconfig(tmp_path: Path) -> None:
    """`AutoConfig` reads it as a Ministral config; `load_hf_config` gives the same."""
    data = {"model_type": "mistral", **TINY, "layer_types": ["full_attention"] * 3}
    assert not reads_light(data)
    assert reads_light(CONFIGS["mistral-no-window"])
    config = load_hf_config(_write(tmp_path, data))
    assert config.model_type == "ministral"


def test_a_config_value_of_the_wrong_type_is_a_config_error_naming_the_file(
    tmp_path: Path,
) -> None:
    model_dir = _write(tmp_path, {"model_type": "llama", **TINY, "hidden_size": "wide"})
    with pytest.raises(ValueError, match=r"config\.json.*hidden_size"):
        load_hf_config(model_dir)


def _assert_same_tokenizer(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    text = "Hello, tandem! <|im_start|>user\nnaïve café 12345<|im_end|>"
    assert got(text)["input_ids"] == want(text)["input_ids"]
    assert (
        got(text, add_special_tokens=False)["input_ids"]
        == want(text, add_special_tokens=False)["input_ids"]
    )
    ids = want(text)["input_ids"]
    assert got.decode(ids) == want.decode(ids)
    assert got.decode(ids, skip_special_tokens=True) == want.decode(ids, skip_special_tokens=True)
    assert got.convert_ids_to_tokens(ids) == want.convert_ids_to_tokens(ids)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.all_special_ids == want.all_special_ids
    assert got.added_tokens_decoder == want.added_tokens_decoder
    assert len(got) == len(want) and got.get_vocab() == want.get_vocab()
    assert got.model_max_length == want.model_max_length
    assert got.padding_side == want.padding_side
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]
    for prompt in (False, True):
        assert got.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt
        ) == want.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def test_the_tokenizer_gets_the_light_config_and_encodes_as_before(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    _assert_same_tokenizer(
        load_tokenizer(smollm2_dir), AutoTokenizer.from_pretrained(str(smollm2_dir))
    )


def test_a_generic_fast_tokenizer_loads_as_auto_tokenizer_loads_it(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """`tokenizer_class` `PreTrainedTokenizerFast` (the alias) is loaded by the generic class
    directly, as `AutoTokenizer` loads it; a class that is not generic still goes through
    `AutoTokenizer` (a GPT-2 tokenizer over the same files)."""
    from transformers import AutoTokenizer

    for named in ("PreTrainedTokenizerFast", "GPT2Tokenizer"):
        target = tmp_path / named
        target.mkdir()
        for name in ("tokenizer.json", "chat_template.jinja", "config.json"):
            if (smollm2_dir / name).exists():
                (target / name).write_bytes((smollm2_dir / name).read_bytes())
        settings = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
        (target / "tokenizer_config.json").write_text(
            json.dumps({**settings, "tokenizer_class": named})
        )
        _assert_same_tokenizer(load_tokenizer(target), AutoTokenizer.from_pretrained(str(target)))


def test_reading_the_config_and_tokenizer_skips_transformers_model_config_modules(
    smollm2_dir: Path,
) -> None:
    """In a fresh process: `load_hf_config` and `load_tokenizer` on the embedded model
    import neither transformers' Llama config module nor `torch.distributed.tensor` (the
    ~70 MB chain `AutoConfig` pulls in), nor `AutoTokenizer`'s module (about 7.6 MB: it
    indexes every model package transformers ships)."""
    heavy = (
        "transformers.models.llama.configuration_llama",
        "torch.distributed.tensor",
        "transformers.models.auto.tokenization_auto",
    )
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from tandem.models.model_files import load_hf_config, load_tokenizer\n"
        f"d = Path({str(smollm2_dir)!r})\n"
        "config = load_hf_config(d)\n"
        "load_tokenizer(d)\n"
        f"print(json.dumps([config.model_type] + [m for m in {heavy!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["llama"]
