"""Host tensors from Python ints, for the worker's per-step index tensors."""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch


def host_int64(values: Sequence[int]) -> torch.Tensor:
    """A CPU int64 tensor of `values`, built from a packed buffer: several times faster
    than `torch.tensor(list)`, which inspects every Python int one by one."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)
