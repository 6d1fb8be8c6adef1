"""Which linear a weight gets on the CPU (activations are float32 in both dtypes).

float32 weights (`cpu_f32_linear`): `panel_linear.F32PanelLinear` (16-column panels,
the 6x16 AVX2 tile of `csrc/panel_gemm.cpp`) when its kernel builds, else None and the
caller keeps oneDNN (`PackedLinear`). Measured with `python benchmarks/panel_linear.py`
on a 2-core AVX2 EPYC, two threads, against oneDNN prepacked: 1.1-1.6x at 1 row, 1.1-1.6x
at 16, 1.05-1.33x at 64 on the layer shapes (the LM head 0.97-1.03), 0.93-1.10 at 512 and
2048 rows. On a 2-core AVX-512 EPYC (the kernel's wide zmm tile): 1.57-1.77x at 1 row,
1.01-1.08x at 16, 0.83-1.02x at 64, 0.82-0.97x at 256: the panel stays the choice there
for its decode advantage (one copy of each weight: no per-row-count switch).
`model.f32_linear` (or `TANDEM_F32_LINEAR`, for A/B runs) picks the layout: `panel` (one
copy), `onednn` (oneDNN everywhere), or `dual`: both copies, the panel kernel up to 16 rows
and oneDNN above (`RowDispatchLinear`). On the AVX-512 EPYC, `python
benchmarks/panel_linear.py --threads 2 --rows 1 16 64 144 256` measured the panel at
1.16-1.69x oneDNN at 1 row, 0.95-1.05x at 16, 0.78-0.90x at 64 and 0.71-0.90x at 144-256;
`python benchmarks/prefill_compare.py --tandem-linears panel,dual` turned offline time to
first token from 1.12-1.30x vLLM-CPU's (144-256 tokens) into 0.98-1.01x. `auto` (the
default) is `dual` there for checkpoints up to 2 GiB (the price: the layers' weights twice),
`panel` elsewhere (on AVX2 the panel won at every row count).

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
from tandem.models.cpu_features import cpu_flags, has_bf16_units
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


#: The worker's float32 linear layout (`configure`); `TANDEM_F32_LINEAR` overrides it.
_f32_mode = "panel"
#: `auto` keeps two copies only for checkpoints up to this size.
DUAL_AUTO_MAX_BYTES = 2 << 30


def configure(mode: str, checkpoint_bytes: int) -> str:
    """Set this process's float32 linear layout from `model.f32_linear` (the loader calls
    it before building the model); returns the resolved mode. `auto`: `dual` on CPUs with
    AVX-512 (where oneDNN beats the panel kernel above 16 rows) for checkpoints of at most
    `DUAL_AUTO_MAX_BYTES`, else `panel`."""
    global _f32_mode
    if mode == "auto":
        wide = "avx512f" in cpu_flags()
        mode = "dual" if wide and checkpoint_bytes <= DUAL_AUTO_MAX_BYTES else "panel"
    _f32_mode = mode
    return mode


def f32_mode() -> str:
    return os.environ.get("TANDEM_F32_LINEAR") or _f32_mode


#: Above this many rows a `RowDispatchLinear` takes its oneDNN copy (the crossover
#: measured on AVX-512: the panel 1.16-1.69x oneDNN at 1 row, 0.95-1.05x at 16).
DUAL_ROWS = 16


class RowDispatchLinear:
    """Two copies of one weight: the panel kernel for up to `DUAL_ROWS` rows (decode), oneDNN
    prepacked above (prefill chunks, large batches), where each is the faster. Twice the
    weight's memory (`TANDEM_F32_LINEAR=dual`)."""

    def __init__(self, small: F32PanelLinear, large: PackedLinear) -> None:
        self.small, self.large = small, large
        self.out_features, self.in_features = small.out_features, small.in_features
        self.bias = small.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(x) if x.shape[0] <= DUAL_ROWS else self.large(x)

    def dense_weight(self) -> torch.Tensor:
        return self.small.dense_weight()


def cpu_f32_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, prefill_copy: bool = True
) -> Linear | None:
    """The panel-kernel linear over its own float32 copy of `weight [out, in]` (and of
    `bias`), or None: not a float32 CPU weight, no kernel, or `TANDEM_F32_LINEAR=onednn`.
    With `TANDEM_F32_LINEAR=dual` (and `prefill_copy`), a `RowDispatchLinear` that also
    keeps a oneDNN-packed copy for products over `DUAL_ROWS` rows."""
    mode = f32_mode()
    if (
        weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or mode == "onednn"
        or not panel_linear.available()
    ):
        return None
    linear = F32PanelLinear(weight.detach(), None)
    if bias is not None:
        linear.bias = bias.detach().float().clone()
    if mode == "dual" and prefill_copy:
        large = PackedLinear(weight.detach(), linear.bias, pack=True)
        if large.packed is not None:
            return RowDispatchLinear(linear, large)
    return linear
