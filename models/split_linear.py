"""`y = x @ w.T (+ b)` with the output features split across CPU threads.

On CPU, MKL's threaded GEMM streams a weight matrix through one core for small batches
(one decode token is a GEMV) and splits larger GEMMs less evenly than it could. Viewing the
weight `[out, in]` as `[threads, out / threads, in]` and calling `bmm` gives each thread its
own contiguous slice of the weight, so every core streams a disjoint part of it. Measured on
the embedded model with two threads (benchmarks/linear_split.py): the 30 decoder layers'
projections 2.5x faster at one token and 1.1-1.2x at 64, the 49152-row LM head 3.3x and
1.2x; from about 512 rows on MKL's own threading is as good or better, so larger inputs
(prefill chunks) keep `F.linear`.

The result equals `F.linear` up to float summation order, but it is column-major (strides
`(1, rows)`): the split output is used as `bmm` wrote it, since a copy to row-major costs
more than it saves downstream. Callers that need row-major call `.contiguous()`. CUDA tensors, one thread, more
than `SPLIT_MAX_ROWS` rows, and weights whose row count the thread count does not divide go
through `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SPLIT_MAX_ROWS = 256


def split_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for 2-D `x [M, in]`; see the module docstring."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    parts = torch.get_num_threads()
    out_features, in_features = weight.shape
    if parts < 2 or out_features % parts or x.dim() != 2 or x.shape[0] > SPLIT_MAX_ROWS:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    y = torch.bmm(weight.view(parts, -1, in_features), x.t()[None].expand(parts, in_features, rows))
    y = y.permute(2, 0, 1).reshape(rows, out_features)  # [parts, out/parts, M] -> [M, out]
    return y if bias is None else y + bias
