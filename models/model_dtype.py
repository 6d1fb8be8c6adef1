"""A model's device, its compute dtype and the KV bytes one token takes: what sizing the KV
pool needs.

Imports torch but not transformers or the model modules, so a loader's `resolve_limits`
(run by every config resolution, `tandem config show` included) stays light.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.core.worker.device import resolve_device  # noqa: F401 - re-exported
from tandem.models.cpu_features import warn_if_bf16_emulated

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA and float32 on CPU (never bfloat16 there: where the CPU
    has no bf16 units it is no faster, and it is less exact). An explicit bfloat16 on a CPU
    without bf16 units (AVX512-BF16 or AMX) runs (weights and KV in bfloat16, float32
    compute) and says so once."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "bfloat16" and device.type == "cpu":
        warn_if_bf16_emulated()
    return DTYPES[name]


def kv_bytes_per_token(
    hf_config: Any, dtype: torch.dtype, kv_heads: int | None = None, layers: int | None = None
) -> int:
    """Bytes of K and V for one token of a transformers config (GQA: `num_key_value_heads`;
    `head_dim` when the config has one, else hidden / heads): over every layer and KV head,
    or over `layers` layers of `kv_heads` heads (one rank's share)."""
    head_dim = (
        getattr(hf_config, "head_dim", None)
        or hf_config.hidden_size // hf_config.num_attention_heads
    )
    elem = torch.empty((), dtype=dtype).element_size()
    layers = hf_config.num_hidden_layers if layers is None else layers
    kv_heads = hf_config.num_key_value_heads if kv_heads is None else kv_heads
    return 2 * layers * kv_heads * head_dim * elem
