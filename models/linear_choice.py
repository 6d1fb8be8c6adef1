"""Which linear a weight gets on the CPU (activations are float32 in both dtypes).

float32 weights (`cpu_f32_linear`): `panel_linear.F32PanelLinear` (16-column panels,
the 6x16 AVX2 tile of `csrc/panel_gemm.cpp`) when its kernel builds, else None and the
caller keeps oneDNN (`PackedLinear`). Measured with `python benchmarks/panel_linear.py`
on a 2-core AVX2 EPYC, two threads, against oneDNN prepacked: 1.1-1.6x at 1 row, 1.1-1.6x
at 16, 1.05-1.33x at 64 on the layer shapes (the LM head 0.97-1.03), 0.93-1.10 at 512 and
2048 rows. On a 2-core AVX-512 EPYC (the kernel's wide zmm tile): 1.57-1.77x at 1 row,
1.01-1.08x at 16, 0.83-1.02x at 64, 0.82-0.97x at 256: the panel stays the choice there
for its decode advantage (one copy of each weight: no per-row-count switch).
`TANDEM_F32_LINEAR=onednn` keeps oneDNN everywhere (for A/B runs).

bfloat16 weights (`cpu_bf16_linear`):

In bfloat16 mode on the CPU tandem stores weights (and the KV cache) in bfloat16 and
computes in float32: activations, the residual stream, norms and logits are float32. Each
linear then takes float32 `x [rows, in]` and returns float32 `y [rows, out]`:

- with bf16 units (AVX512-BF16 / AMX, `cpu_features.has_bf16_units`) and a oneDNN that
  reorders the bfloat16 weight: `PackedLinear` on the prepacked bfloat16 weight (the input
  is cast to bfloat16 for the GEMM, the output back to float32);
- otherwise `panel_linear.Bf16Linear`: weight-only bfloat16 (the weight in a packed panel
  layout, float32 products and accumulation; its own torch fallback without a compiler).

Either holds one bfloat16 copy of the weight in its own memory (never a view of the
caller's tensor, which may be released or map the checkpoint file), and its own bias.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from tandem.models import panel_linear
from tandem.models.cpu_features import has_bf16_units
from tandem.models.packed_linear import PackedLinear
from tandem.models.panel_linear import Bf16Linear, F32PanelLinear


class Linear(Protocol):
    """The interface the fused decoder and the LM head use (`PackedLinear`'s)."""

    out_features: int
    in_features: int
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def dense_weight(self) -> torch.Tensor: ...


def _onednn_bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
    """A `PackedLinear` on the oneDNN-reordered bfloat16 weight, or None where there are no
    bf16 units or oneDNN does not reorder it."""
    if not has_bf16_units():
        return None
    linear = PackedLinear(weight.to(torch.bfloat16), bias, pack=True)
    if linear.packed is None:
        return None
    if linear.bias is not None:
        linear.bias = linear.bias.to(torch.bfloat16).clone()
    return linear


def cpu_bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """The float32-in, float32-out linear over a bfloat16 copy of `weight [out, in]` (see
    the module docstring for the choice)."""
    weight = weight.detach()
    bias = bias.detach() if bias is not None else None
    packed = _onednn_bf16(weight, bias)
    if packed is not None:
        return packed
    linear = Bf16Linear(weight.to(torch.bfloat16), bias)
    if linear.weight is not None and linear.weight.data_ptr() == weight.data_ptr():
        linear.weight = linear.weight.clone()  # its fallback kept the caller's tensor
    return linear


def cpu_f32_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear | None:
    """The panel-kernel linear over its own float32 copy of `weight [out, in]` (and of
    `bias`), or None: not a float32 CPU weight, no kernel, or `TANDEM_F32_LINEAR=onednn`."""
    if (
        weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or os.environ.get("TANDEM_F32_LINEAR", "panel") == "onednn"
        or not panel_linear.available()
    ):
        return None
    linear = F32PanelLinear(weight.detach(), None)
    if bias is not None:
        linear.bias = bias.detach().float().clone()
    return linear
