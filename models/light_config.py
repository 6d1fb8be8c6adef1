"""`config.json` of the Llama family read without transformers' model config classes.

Importing `transformers.models.llama.configuration_llama` (or the qwen2, qwen3 and
mistral ones, which `AutoConfig` does) pulls in transformers' activations, hub-kernel and
checkpoint-conversion modules and, through them, `torch.distributed.tensor` and sympy:
about 70 MB of resident memory to read a dozen numbers. The classes here are
`PreTrainedConfig` subclasses, type-checked by `@strict` as transformers' are, with the
same fields, defaults and `__post_init__` rules as transformers' four classes and nothing
else (no tensor-parallel plans, no value-range validators), so the base class does the
rest exactly as for transformers' own: unknown keys kept as attributes
(`quantization_config`), `torch_dtype` -> `dtype`, rotary parameters standardised into
`rope_parameters`, generation keys dropped.

Contract (held by tests/model/test_light_config.py): for a `config.json` of one of
`LIGHT_CONFIG_TYPES`, `light_config(path).to_dict()` equals
`AutoConfig.from_pretrained(dir).to_dict()`, and `model_type` is the same string, so a
tokenizer lookup by model type finds the same class. A config `reads_light` refuses is
not handled here; load it with `AutoConfig`.
"""

# No `from __future__ import annotations`: `@strict` checks values against the field
# annotations, which must be real types, not strings.
from pathlib import Path
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig


@strict
class _LlamaFamilyConfig(PreTrainedConfig):
    """What transformers' `LlamaConfig` and `MistralConfig` share: their common fields
    (same defaults) and `__post_init__` (head_dim and KV heads derived when missing)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    head_dim: int | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_dropout: int | float | None = 0.0

    def __post_init__(self, **kwargs: Any) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        super().__post_init__(**kwargs)


@strict
class LightLlamaConfig(_LlamaFamilyConfig):
    """transformers' `LlamaConfig`: the family's fields plus its own, and its
    architecture check."""

    model_type = "llama"

    intermediate_size: int = 11008
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 2048
    pretraining_tp: int | None = 1
    attention_bias: bool = False
    mlp_bias: bool = False

    def validate_architecture(self) -> None:
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"The hidden size ({self.hidden_size}) is not a multiple of the number of "
                f"attention heads ({self.num_attention_heads})."
            )


@strict
class LightMistralConfig(_LlamaFamilyConfig):
    """transformers' `MistralConfig`: the family's fields plus its own."""

    model_type = "mistral"

    intermediate_size: int = 14336
    num_key_value_heads: int = 8
    max_position_embeddings: int = 4096 * 32
    sliding_window: int | None = 4096


@strict
class _QwenConfig(PreTrainedConfig):
    """What transformers' `Qwen2Config` and `Qwen3Config` share: the sliding-window
    fields and the per-layer attention types derived from them."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: list[str] | None = None
    attention_dropout: float | int = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        self.sliding_window = self.sliding_window if self.use_sliding_window else None
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention"
                if self.sliding_window is not None and i >= self.max_window_layers
                else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        super().__post_init__(**kwargs)


@strict
class LightQwen2Config(_QwenConfig):
    """transformers' `Qwen2Config`."""

    model_type = "qwen2"


@strict
class LightQwen3Config(_QwenConfig):
    """transformers' `Qwen3Config`: Qwen2's fields plus `head_dim` and `attention_bias`."""

    model_type = "qwen3"

    head_dim: int = 128
    attention_bias: bool = False


#: model_type -> the class that reads its config.json.
LIGHT_CONFIG_CLASSES: dict[str, type[PreTrainedConfig]] = {
    cls.model_type: cls
    for cls in (LightLlamaConfig, LightMistralConfig, LightQwen2Config, LightQwen3Config)
}
LIGHT_CONFIG_TYPES = frozenset(LIGHT_CONFIG_CLASSES)


def reads_light(data: dict[str, Any]) -> bool:
    """Whether `light_config` reads a `config.json` with these contents. Not a Mistral
    config with `layer_types`: `AutoConfig` reads that one as a Ministral config."""
    model_type = data.get("model_type")
    return model_type in LIGHT_CONFIG_TYPES and not (
        model_type == "mistral" and "layer_types" in data
    )


def light_config(model_dir: Path, model_type: str) -> PreTrainedConfig:
    """The config of `model_dir` (whose `config.json` names `model_type`, and which
    `reads_light`), built as `AutoConfig.from_pretrained` builds it (see the module
    docstring); `KeyError` for a `model_type` outside `LIGHT_CONFIG_TYPES`."""
    path = str(model_dir)
    return LIGHT_CONFIG_CLASSES[model_type].from_pretrained(path, name_or_path=path)
