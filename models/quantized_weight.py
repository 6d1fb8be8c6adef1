"""Weight-only quantized tensors: integer codes with group-wise float scales.

A `QuantizedWeight` holds a `[out, in]` weight as

    w[o, i] = scale[o, i // group] * code[o, i] + min[o, i // group]

with unsigned codes of `bits` 8 (0..255) or 4 (0..15). Every scale is a float16 value held
in float32 (GGUF's own, or rounded to float16 when quantizing here), so `scale * code` is
exact in float32 and the dequantized weight is one rounding of the sum: the compiled
kernel's FMA and torch's multiply-then-add give the same bits (`dequantize`). Signed
formats keep their codes offset: Q8_0's `d * q` is held as `d * (q + 128) + (-128 d)` and
Q4_0's `d * (q - 8)` as `d * q + (-8 d)`; both terms are exact, so is their sum, and GGUF's
Q4_0, Q4_1 and Q8_0 dequantize bit for bit to the values gguf's reference dequantizer
gives. `mins` is None only where every min is zero.

Sources: `quantize_int8` (per output channel, symmetric; or group-wise, the better of a
symmetric and a min/max grid per group), `quantize_int4` (group-wise, min/max affine) from
float weights, and `from_gguf_blocks` for GGUF tensors of the `GGUF_KEPT_TYPES` (their
blocks repacked as integers and scales, no float round trip).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

#: GGUF tensor types kept quantized (others dequantize to float at load).
GGUF_KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
#: Elements per GGUF block and bytes per block of the kept types.
_GGUF_BLOCK = 32
_GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
#: int4 group sizes `quantize_int4` takes (vLLM's and torch's usual ones).
INT4_GROUP_SIZES = (32, 64, 128)
_FP16_MAX = 65504.0


@dataclass(frozen=True)
class QuantizedWeight:
    """`codes [out, in]` uint8 (0..255 for 8 bits, 0..15 for 4), `scales [out, groups]` and
    `mins [out, groups]` (None: all zero) float32, groups = ceil(in / group_size). `kind`
    names the format for logs and reports (`"Q4_1"`, `"int8-g32"`, ...)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int
    kind: str

    def __post_init__(self) -> None:
        out, inn = self.codes.shape
        groups = -(-inn // self.group_size)
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if tuple(self.scales.shape) != (out, groups):
            raise ValueError(f"scales must be [{out}, {groups}], got {tuple(self.scales.shape)}")
        if self.mins is not None and self.mins.shape != self.scales.shape:
            raise ValueError("mins must have the shape of scales")
        if self.bits == 4 and (inn % 2 or self.group_size % 2):
            raise ValueError("int4 weights need an even input size and group size")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def _expand(self, per_group: torch.Tensor) -> torch.Tensor:
        return per_group.repeat_interleave(self.group_size, dim=1)[:, : self.codes.shape[1]]

    def dequantize(self) -> torch.Tensor:
        """The float32 `[out, in]` weight (exact, see the module docstring)."""
        product = self._expand(self.scales) * self.codes.float()
        return product + self._expand(self.mins) if self.mins is not None else product

    def row_block(self, part: int, parts: int) -> QuantizedWeight:
        """Rows `part*n .. (part+1)*n` of `parts` equal blocks (a tensor-parallel shard)."""
        if parts == 1:
            return self
        n = self.shape[0] // parts
        rows = slice(part * n, (part + 1) * n)
        mins = self.mins[rows] if self.mins is not None else None
        return replace(self, codes=self.codes[rows], scales=self.scales[rows], mins=mins)

    def col_block(self, part: int, parts: int) -> QuantizedWeight:
        """Columns `part*n .. (part+1)*n` of `parts` equal blocks; each block must hold
        whole groups (ValueError naming the sizes otherwise)."""
        if parts == 1:
            return self
        n = self.shape[1] // parts
        if n % self.group_size:
            raise ValueError(
                f"a {self.kind} weight of {self.shape[1]} inputs in groups of "
                f"{self.group_size} cannot split into {parts} column blocks of whole groups"
            )
        g = n // self.group_size
        groups = slice(part * g, (part + 1) * g)
        mins = self.mins[:, groups] if self.mins is not None else None
        return replace(
            self,
            codes=self.codes[:, part * n : (part + 1) * n],
            scales=self.scales[:, groups],
            mins=mins,
        )

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts stacked by rows (fused Q/K/V or gate/up); they must share bits and
        group size (ValueError otherwise)."""
        first = parts[0]
        if any((p.bits, p.group_size) != (first.bits, first.group_size) for p in parts):
            kinds = sorted({p.kind for p in parts})
            raise ValueError(f"cannot fuse quantized weights of different formats {kinds}")
        mins = None
        if any(p.mins is not None for p in parts):
            mins = torch.cat(
                [p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts]
            )
        kind = "+".join(sorted({p.kind for p in parts}))
        return QuantizedWeight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
            first.bits,
            first.group_size,
            kind,
        )


def _fp16_scales(values: torch.Tensor) -> torch.Tensor:
    """Scales rounded to float16 values (held in float32), zero (an all-zero group) -> 1."""
    rounded = values.clamp(max=_FP16_MAX).to(torch.float16).float()
    return torch.where(rounded > 0, rounded, torch.ones_like(rounded))


def _finite(weight: torch.Tensor) -> torch.Tensor:
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight holding inf or NaN")
    return w


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """`[out, groups, group_size]`, a short last group padded with its last column."""
    out, inn = w.shape
    groups = -(-inn // group_size)
    pad = groups * group_size - inn
    padded = torch.cat([w, w[:, -1:].expand(out, pad)], dim=1) if pad else w
    return padded.view(out, groups, group_size)


def _affine_grid(
    grouped: torch.Tensor, levels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, mins) of the min/max grid of `levels` steps per group."""
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    mins = low.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).float()
    scales = _fp16_scales((high - mins) / levels)
    codes = torch.round((grouped - mins[..., None]) / scales[..., None]).clamp(0, levels)
    return codes, scales, mins


#: Rows quantized at a time: the float temporaries of one block stay a few MB.
_ROW_BLOCK = 2048


def _by_row_blocks(quantize: Any, weight: torch.Tensor, *args: Any) -> QuantizedWeight:
    """`quantize(weight, *args)` applied to blocks of `_ROW_BLOCK` rows, stacked (every
    format here is per row, so the result is the same as one call's)."""
    if weight.shape[0] <= _ROW_BLOCK:
        return quantize(weight, *args)
    parts = [quantize(block, *args) for block in weight.split(_ROW_BLOCK)]
    return QuantizedWeight.cat(parts)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """int8 weights. `group_size` None: symmetric per output channel (vLLM's W8 per-channel):
    scale = max|w| / 127 (float16), codes round(w / scale) in [-127, 127]. A group size:
    per group of that many inputs, whichever of that symmetric grid and the min/max grid
    (scale = (max - min) / 255, min) has the smaller squared error: a weight already on a
    4- or 8-bit grid (a GGUF's, dequantized) is then re-expressed (nearly) exactly."""
    return _by_row_blocks(_quantize_int8, weight, group_size)


def _quantize_int8(weight: torch.Tensor, group_size: int | None) -> QuantizedWeight:
    w = _finite(weight)
    out, inn = w.shape
    grouped = w[:, None, :] if group_size is None else _grouped(w, group_size)
    sym_scales = _fp16_scales(grouped.abs().amax(dim=-1) / 127)
    sym_codes = torch.clamp(torch.round(grouped / sym_scales[..., None]), -127, 127) + 128
    sym_mins = -128 * sym_scales
    kind = "int8" if group_size is None else f"int8-g{group_size}"
    if group_size is None:
        codes, scales, mins = sym_codes, sym_scales, sym_mins
    else:
        aff_codes, aff_scales, aff_mins = _affine_grid(grouped, 255)

        def error(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
            values = codes * scales[..., None] + mins[..., None]
            return ((values - grouped) ** 2).sum(dim=-1)

        symmetric = error(sym_codes, sym_scales, sym_mins) <= error(aff_codes, aff_scales, aff_mins)
        codes = torch.where(symmetric[..., None], sym_codes, aff_codes)
        scales = torch.where(symmetric, sym_scales, aff_scales)
        mins = torch.where(symmetric, sym_mins, aff_mins)
    codes = codes.reshape(out, -1)[:, :inn].to(torch.uint8)
    return QuantizedWeight(codes, scales, mins, 8, group_size or inn, kind)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric int4 in groups of `group_size` inputs: min and scale = (max - min) / 15
    per group (float16), codes round((w - min) / scale) in 0..15. A last group shorter than
    `group_size` (inputs not a multiple of it) is padded with its last column's values."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(
            f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got {group_size}"
        )
    return _by_row_blocks(_quantize_int4, weight, group_size)


def _quantize_int4(weight: torch.Tensor, group_size: int) -> QuantizedWeight:
    w = _finite(weight)
    codes, scales, mins = _affine_grid(_grouped(w, group_size), 15)
    codes = codes.reshape(w.shape[0], -1)[:, : w.shape[1]].to(torch.uint8)
    return QuantizedWeight(codes, scales, mins, 4, group_size, f"int4-g{group_size}")


def from_gguf_blocks(kind: str, data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor of type `kind` (one of `GGUF_KEPT_TYPES`) from its raw blocks `data`
    (uint8, `[out, blocks * block_bytes]` as gguf's reader gives them) for a weight of
    `shape` `[out, in]`: codes and float16 scales copied out of the blocks as integers."""
    if kind not in GGUF_KEPT_TYPES:
        raise ValueError(f"GGUF type {kind} is not kept quantized (kept: {GGUF_KEPT_TYPES})")
    out, inn = shape
    if inn % _GGUF_BLOCK:
        raise ValueError(f"a {kind} tensor needs rows of whole {_GGUF_BLOCK}-blocks, got {inn}")
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8))  # a copy: the file maps read-only
    blocks = blocks.view(out, inn // _GGUF_BLOCK, _GGUF_BLOCK_BYTES[kind])

    def half(start: int) -> torch.Tensor:
        return blocks[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()

    scale = half(0)
    if kind == "Q8_0":
        # int8 two's complement with its sign bit flipped is q + 128 (uint8), exactly
        codes = (blocks[..., 2:] ^ 0x80).reshape(out, inn)
        return QuantizedWeight(codes, scale, -128 * scale, 8, _GGUF_BLOCK, kind)
    nibbles = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    # byte j of a block: element j in the low nibble, element j + 16 in the high
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(out, inn)
    minimum = half(2) if kind == "Q4_1" else -8 * scale
    return QuantizedWeight(codes, scale, minimum, 4, _GGUF_BLOCK, kind)
