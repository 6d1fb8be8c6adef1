"""Helpers shared by the structured-output tests."""

from __future__ import annotations

from typing import Any

import torch

from tandem.structured_output.backend import allocate_bitmask

BACKENDS = ["xgrammar", "outlines"]
SCHEMA = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
    "required": ["x", "tag"],
}
EOS = 2


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    """Token ids whose bit is set in `bitmask[row]`."""
    bits = (bitmask[row, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.reshape(-1)[:vocab].nonzero().squeeze(1).tolist())


def fill(matcher: Any, vocab: int) -> set[int]:
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0)
    return allowed(bitmask, 0, vocab)
