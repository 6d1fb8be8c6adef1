"""A Llama-family causal LM's module tree, built without transformers' model classes.

Where the fused decoder reads the weights from the files by name (`hf_model._skeleton`: a
GGUF kept quantized, a rank's share, quantization at load layer by layer), the model it is
given is a skeleton: meta parameters, real rotary buffers, and the modules the worker keeps
whole (embedding, final norm, a tied or untied LM head) filled in from the checkpoint. The
decoder, the LM head and the drafters read only the tree's names and shapes (the
checkpoint's names, `model.layers.{i}.self_attn.q_proj.weight`, ...), its config, the
embedding, the final norm and the rotary module; transformers' decoder layers never run.

Importing transformers' model classes costs about 98 MB of resident memory (71 MB of it
`torch._dynamo`, which `transformers.modeling_utils` imports through
`torch.distributed.tensor`), about as much as a quantized SmolLM2's weights. This tree
needs none of it: `SkeletonCausalLM` matches transformers' model parameter for parameter
(names, shapes, biases, Qwen3's per-head q/k norms, the tied head), its rotary module
returns transformers' cos/sin bit for bit (the same init functions from
`transformers.modeling_rope_utils`, the same arithmetic, `dynamic_rope_update` for the
dynamic types), and the final norm's forward is Llama's RMSNorm
(`tests/model/test_light_skeleton.py` holds all three to transformers' own).

Covers `SKELETON_MODEL_TYPES`; any other model type gets transformers' classes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: The model types built here (the fused decoder's Llama family).
SKELETON_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _meta(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device="meta", dtype=dtype), requires_grad=False)


class MetaLinear(nn.Module):
    """`nn.Linear`'s parameters (`weight [out, in]`, optional `bias`) and forward, created
    on the meta device without `nn.Linear`'s initialisation (which on meta tensors goes
    through torch's reference ops and imports `torch._dynamo`)."""

    def __init__(self, inputs: int, outputs: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = inputs, outputs
        self.weight = _meta(outputs, inputs, dtype=dtype)
        self.bias = _meta(outputs, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def _linear(inputs: int, outputs: int, bias: bool, dtype: torch.dtype) -> MetaLinear:
    return MetaLinear(inputs, outputs, bias, dtype)


class RMSNorm(nn.Module):
    """Llama's RMSNorm: the norm in float32, scaled by the weight in the input's dtype."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _meta(size, dtype=dtype)
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden.to(input_dtype)


def _default_rope_parameters(config: Any, *_: Any, **__: Any) -> tuple[torch.Tensor, float]:
    """transformers' `default` rotary type: `1 / base ** (2i / dim)`, no cos/sin scaling."""
    base = config.rope_parameters["rope_theta"]
    dim = _head_dim(config)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _dynamic_rope_update(forward: Any) -> Any:
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(forward)


class RotaryEmbedding(nn.Module):
    """transformers' rotary module for these model types: `forward(x, position_ids)` gives
    `(cos, sin)` `[batch, T, head_dim]` in `x`'s dtype. The attributes are transformers'
    own (`dynamic_rope_update` reads them)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        init = (
            _default_rope_parameters
            if self.rope_type == "default"
            else ROPE_INIT_FUNCTIONS[self.rope_type]
        )
        inv_freq, self.attention_scaling = init(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @_dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class _Attention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        head_dim, hidden = _head_dim(config), config.hidden_size
        q_width = config.num_attention_heads * head_dim
        kv_width = config.num_key_value_heads * head_dim
        qwen2 = config.model_type == "qwen2"
        qkv_bias = qwen2 or bool(getattr(config, "attention_bias", False))
        o_bias = not qwen2 and bool(getattr(config, "attention_bias", False))
        self.q_proj = _linear(hidden, q_width, qkv_bias, dtype)
        self.k_proj = _linear(hidden, kv_width, qkv_bias, dtype)
        self.v_proj = _linear(hidden, kv_width, qkv_bias, dtype)
        self.o_proj = _linear(q_width, hidden, o_bias, dtype)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps, dtype)


class _MLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = _linear(hidden, inner, bias, dtype)
        self.up_proj = _linear(hidden, inner, bias, dtype)
        self.down_proj = _linear(inner, hidden, bias, dtype)


class _DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = _Attention(config, dtype)
        self.self_attn.layer_idx = layer_idx
        self.mlp = _MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class _Model(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        table = _meta(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens: nn.Module = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=table, _freeze=True
        )
        self.layers = nn.ModuleList(
            _DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config)


class SkeletonCausalLM(nn.Module):
    """The causal LM's tree: every parameter a meta tensor in `dtype` (the LM head tied to
    the embedding when the config says so), the rotary buffers real on the CPU. The
    accessors are transformers' (`config`, `dtype`, `get_input_embeddings`, ...)."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if config.model_type not in SKELETON_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r}: the skeleton covers "
                f"{sorted(SKELETON_MODEL_TYPES)}"
            )
        self.config = config
        self._dtype = dtype
        self.model = _Model(config, dtype)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype)
        self.tie_weights()

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def set_input_embeddings(self, embedding: nn.Module) -> None:
        self.model.embed_tokens = embedding

    def tie_weights(self) -> None:
        """The LM head shares the embedding's weight when the config ties them."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
