"""Linear layers with weights prepacked for oneDNN (CPU, float32).

`torch.ops.mkldnn._linear_pointwise` on a weight reordered once by
`_reorder_linear_weight` skips MKL's per-call packing and uses oneDNN's blocked GEMM.
Measured on the embedded model with two threads (`python benchmarks/linear_split.py`): the
30 layers' projections 1.3-1.4x faster than `split_linear` at 64 rows and ~1.6x at 2048
(prefill); at one row (a batch-1 decode) `split_linear` streams the weights faster (the LM
head 1.3x), so by default `PackedLinear` keeps the plain weight for that case too
(`keep_weight_for_gemv`; the packed copy is the extra memory either way).

Without oneDNN (CUDA tensors, other dtypes, a torch built without mkldnn) `PackedLinear`
falls back to `split_linear` on the plain weight. Results equal `F.linear` up to float
summation order; outputs are row-major.
"""

from __future__ import annotations

import torch

from tandem.core.worker.split_linear import split_linear

#: The batch size oneDNN is told to expect when reordering (a hint; any row count works).
PACK_ROWS_HINT = 64


def onednn_usable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear:
    """`y = x @ weight.T + bias` for 2-D `x [rows, in]`, with the weight prepacked."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        keep_weight_for_gemv: bool = True,
    ) -> None:
        weight = weight.detach()
        self.bias = bias.detach() if bias is not None else None
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor | None = None
        if onednn_usable(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
            except RuntimeError:
                self.packed = None
        #: The plain weight, kept only when it is needed (fallback, or the 1-row path).
        self.weight = weight if self.packed is None or keep_weight_for_gemv else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or (self.weight is not None and x.shape[0] == 1):
            assert self.weight is not None
            return split_linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
