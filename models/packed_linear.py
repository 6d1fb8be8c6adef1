"""Linear layers with weights prepacked for oneDNN (CPU, float32), one copy of each weight.

`torch.ops.mkldnn._linear_pointwise` on a weight reordered once by
`_reorder_linear_weight` skips MKL's per-call packing and uses oneDNN's blocked GEMM.
Measured on the embedded model with two threads (`python benchmarks/linear_split.py`): the
30 layers' projections 1.3-1.4x faster than `split_linear` at 64 rows and ~1.6x at 2048
(prefill).

A `PackedLinear` holds exactly one copy of its weight: the packed one when oneDNN takes it
(the plain weight is dropped, so the caller's tensor can be freed), else the plain one, used
through `split_linear` at every row count (CUDA tensors, dtypes other than float32, a torch
built without mkldnn, or `pack=False`). One row (a batch-1 decode) goes through the packed
weight too, rather than keeping a second, plain copy for `split_linear`: with one thread the
30 layers' one-row GEMVs took the same time packed as plain (ratio 0.996), the LM head 0.79x;
with two threads on a loaded 2-core machine the layers' ratio ranged 0.78-1.29 over three
runs (no clean measurement; rerun `benchmarks/weights_memory.py --speed` on a quiet one).
`keep_weight_for_gemv=True` restores the old two-copy layout (plain weight for one row,
packed for more) for benchmarks only.

bfloat16 weights are packed too where the CPU has bf16 units (`cpu_features.has_bf16_units`)
and oneDNN reorders them: the call then casts a float32 input to bfloat16 for the GEMM and
returns float32 (`linear_choice.cpu_bf16_linear` picks this; without units bfloat16 weights
are not packed here). `call_bf16` skips both casts (bfloat16 in and out) for a caller that
keeps the GEMM's operands in bfloat16 (`FusedDecoder`'s bf16 path): the same GEMM, so the
same bits as the float32 call's output before its widening.

Results equal `F.linear` up to float summation order; outputs are row-major for the packed
path and may be column-major for `split_linear` (see there).
"""

from __future__ import annotations

import torch

from tandem.models.cpu_features import has_bf16_units
from tandem.models.split_linear import split_linear

#: The batch size oneDNN is told to expect when reordering (a hint; any row count works).
PACK_ROWS_HINT = 64


def onednn_usable(weight: torch.Tensor) -> bool:
    """float32 CPU weights, and bfloat16 ones where the CPU has bf16 units."""
    dtype_ok = weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and has_bf16_units()
    )
    return (
        weight.device.type == "cpu"
        and dtype_ok
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-reordered copy of `weight`, or None where oneDNN cannot take it."""
    if not onednn_usable(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
    except RuntimeError:
        return None


class PackedLinear:
    """`y = x @ weight.T + bias` for 2-D `x [rows, in]`.

    After construction exactly one of `packed` (oneDNN layout) and `weight` (the caller's
    tensor, detached: the same storage, not a copy) is set, unless `keep_weight_for_gemv`
    asks for both. `bias` is the caller's tensor, detached.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        keep_weight_for_gemv: bool = False,
        pack: bool = True,
    ) -> None:
        weight = weight.detach()
        self.bias = bias.detach() if bias is not None else None
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor | None = _pack(weight) if pack else None
        #: The plain weight, kept only without a packed one (or when asked to keep both).
        self.weight = weight if self.packed is None or keep_weight_for_gemv else None

    def dense_weight(self) -> torch.Tensor:
        """The plain `[out, in]` weight: the kept tensor itself, or a new tensor unpacked
        (exactly) from the oneDNN copy, for callers that need rows of it (e.g. a drafter's
        reduced vocabulary)."""
        if self.weight is not None:
            return self.weight
        assert self.packed is not None
        return self.packed.to_dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or (self.weight is not None and x.shape[0] == 1):
            assert self.weight is not None
            return split_linear(x, self.weight, self.bias)
        if self.packed.dtype == torch.bfloat16:  # bf16 GEMM, float32 in and out
            y = torch.ops.mkldnn._linear_pointwise(
                x.to(torch.bfloat16), self.packed, self.bias, "none", [], ""
            )
            return y.float()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def takes_bf16(self) -> bool:
        """Whether `call_bf16` serves: the weight is packed in bfloat16."""
        return self.packed is not None and self.packed.dtype == torch.bfloat16

    def call_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """The bfloat16 GEMM on a bfloat16 `x`, its bfloat16 output (only if `takes_bf16`)."""
        assert self.packed is not None
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
