"""Weight-only quantized tensors: integer codes with group-wise float scales.

A `QuantizedWeight` holds a `[out, in]` weight as

    w[o, i] = scale[o, i // group] * code[o, i] + min[o, i // group]

with unsigned codes of `bits` 8 (0..255) or 4 (0..15), scales and mins float32. Invariant:
every `scale * code` is exact in float32 (the scale's significand and the code's bits fit
in float32's 24), so the dequantized weight is one rounding of the sum: the compiled
kernel's FMA and torch's multiply-then-add give the same bits (`dequantize`). The scales
are float16 values (11 significant bits) for every format but the K-quants, whose
`d * sc` products of a float16 and a 6- or 8-bit integer have at most 18 bits (Q4_K's 4-bit
codes: 22 bits in all; Q6_K's 6-bit codes: 24).

GGUF types, each bit for bit what gguf's reference dequantizer (`gguf.quants.dequantize`)
gives, as a value (a weight of zero may come out +0 where gguf gives -0):

- Q4_0 `d * (q - 8)` as `d * q + (-8 d)`; Q8_0 `d * q` as `d * (q + 128) + (-128 d)`;
  Q4_1 `d * q + m`: blocks of 32 are groups of 32, float16 scales.
- Q4_K (super-blocks of 256: fp16 `d`, `dmin`, eight 6-bit `sc`, `m`): gguf computes
  `fl(fl(d * sc) * q - fl(dmin * m))`, both products exact, so int4 codes in groups of 32
  with scale `d * sc` and min `-(dmin * m)` (float32) round the same sum once.
- Q6_K (fp16 `d`, sixteen int8 `sc`, 6-bit `q`): gguf's `fl(d * sc) * (q - 32)` is exact,
  so 8-bit codes `q` (0..63) in groups of 16 with scale `d * sc` and min `-32 d sc` (both
  terms exact, and so their sum).

`mins` is None only where every min is zero. Sources: `quantize_int8` (per output channel,
symmetric; or group-wise, the better of a symmetric and a min/max grid per group),
`quantize_int4` (group-wise, min/max affine) from float weights, and `from_gguf_blocks` for
GGUF tensors of the `GGUF_KEPT_TYPES` (their blocks repacked as integers and scales, no
float round trip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

#: GGUF tensor types kept quantized (others dequantize to float at load).
GGUF_KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
#: (elements, bytes) per GGUF block of the kept types.
GGUF_BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}
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

    def regroup(self, bits: int, group_size: int) -> QuantizedWeight:
        """The same weight (bit for bit) as codes of `bits` in groups of `group_size`: codes
        widened (4 -> 8 bits keeps their values), each group's scale and min repeated over
        the smaller groups it splits into. `bits` must be at least `self.bits` and
        `group_size` divide `self.group_size` (ValueError otherwise)."""
        if (bits, group_size) == (self.bits, self.group_size):
            return self
        if bits < self.bits or self.group_size % group_size:
            raise ValueError(
                f"a {self.kind} weight ({self.bits}-bit codes, groups of {self.group_size}) "
                f"cannot be held exactly as {bits}-bit codes in groups of {group_size}"
            )
        repeat = self.group_size // group_size
        groups = -(-self.shape[1] // group_size)

        def split(per_group: torch.Tensor) -> torch.Tensor:
            return per_group.repeat_interleave(repeat, dim=1)[:, :groups].contiguous()

        mins = split(self.mins) if self.mins is not None else None
        return QuantizedWeight(self.codes, split(self.scales), mins, bits, group_size, self.kind)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts stacked by rows (fused Q/K/V or gate/up). Parts of different formats (a
        GGUF's Q4_K Q and K with a Q6_K V) are first `regroup`ed to their `common_format`,
        exactly; ValueError where they have none."""
        kind = "+".join(sorted({p.kind for p in parts}))
        common = common_format(parts)
        if common is None:
            raise ValueError(f"cannot fuse quantized weights of different formats {kind}")
        parts = [p.regroup(*common) for p in parts]
        mins = None
        if any(p.mins is not None for p in parts):
            mins = torch.cat(
                [p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts]
            )
        return QuantizedWeight(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
            *common,
            kind,
        )


def common_format(parts: list[QuantizedWeight]) -> tuple[int, int] | None:
    """`(bits, group_size)` every part can be `regroup`ed to exactly and the kernel takes:
    the widest codes and the greatest common group size; None when the parts' input sizes
    differ or those groups would not hold whole 32-bit words of codes (one group aside)."""
    inputs = {p.shape[1] for p in parts}
    bits = max(p.bits for p in parts)
    group = math.gcd(*(p.group_size for p in parts))
    if len(inputs) != 1 or (group % (32 // bits) and group < inputs.pop()):
        return None
    return bits, group


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
    `shape` `[out, in]`: codes copied out of the blocks as integers, scales and mins made
    exactly (see the module docstring for each type's mapping)."""
    if kind not in GGUF_KEPT_TYPES:
        raise ValueError(f"GGUF type {kind} is not kept quantized (kept: {GGUF_KEPT_TYPES})")
    out, inn = shape
    block, block_bytes = GGUF_BLOCKS[kind]
    if inn % block:
        raise ValueError(f"a {kind} tensor needs rows of whole {block}-blocks, got {inn}")
    raw = torch.from_numpy(np.array(data, dtype=np.uint8))  # a copy: the file maps read-only
    if raw.numel() != out * (inn // block) * block_bytes:
        raise ValueError(
            f"a {kind} tensor of shape {shape} needs {out * inn // block * block_bytes} "
            f"bytes of blocks, got {raw.numel()}"
        )
    blocks = raw.view(out, inn // block, block_bytes)
    if kind == "Q4_K":
        return _q4_k(blocks, out, inn)
    if kind == "Q6_K":
        return _q6_k(blocks, out, inn)
    scale = _half(blocks, 0)
    if kind == "Q8_0":
        # int8 two's complement with its sign bit flipped is q + 128 (uint8), exactly
        codes = (blocks[..., 2:] ^ 0x80).reshape(out, inn)
        return QuantizedWeight(codes, scale, -128 * scale, 8, block, kind)
    nibbles = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
    # byte j of a block: element j in the low nibble, element j + 16 in the high
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(out, inn)
    minimum = _half(blocks, 2) if kind == "Q4_1" else -8 * scale
    return QuantizedWeight(codes, scale, minimum, 4, block, kind)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 `[out, blocks]` (exact)."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()


def _q4_k(blocks: torch.Tensor, out: int, inn: int) -> QuantizedWeight:
    """Q4_K super-blocks `[out, n, 144]`: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and
    mins, 128 bytes of nibbles -> int4 codes in groups of 32 (see the module docstring)."""
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    packed = blocks[..., 4:16]
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    # sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7:
    # the nibbles of bytes 8-11 with the top 2 bits of bytes 0-3 (4-7) above them
    sc = torch.cat([low & 63, (high & 15) | ((low >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)
    scales = (d[..., None] * sc.float()).reshape(out, -1)  # exact: 11 + 6 bits
    mins = -(dmin[..., None] * mn.float()).reshape(out, -1)
    # bytes 32j .. 32j + 31: sub-block 2j in the low nibbles, sub-block 2j + 1 in the high
    nibbles = blocks[..., 16:].reshape(out, -1, 4, 1, 32)
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=3).reshape(out, inn)
    return QuantizedWeight(codes, scales, mins, 4, 32, "Q4_K")


def _q6_k(blocks: torch.Tensor, out: int, inn: int) -> QuantizedWeight:
    """Q6_K super-blocks `[out, n, 210]`: 128 bytes of low nibbles, 64 of high 2-bit
    pairs, 16 int8 scales, fp16 d -> 8-bit codes q (0..63) in groups of 16, min -32 scale."""
    low = blocks[..., 0:128].reshape(out, -1, 2, 1, 64)
    high = blocks[..., 128:192].reshape(out, -1, 2, 1, 32)
    # element 128h + r of a super-block: low nibble of byte 64h + r % 64 (the high nibble
    # from r = 64), bits 2 (r // 32) .. of byte 32h + r % 32 above it
    low4 = torch.cat([low & 15, low >> 4], dim=3).reshape(out, -1, 2, 128)
    high2 = torch.cat([(high >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(out, -1, 2, 128)
    codes = (low4 | (high2 << 4)).reshape(out, inn)
    sc = blocks[..., 192:208].contiguous().view(torch.int8)
    scales = (_half(blocks, 208)[..., None] * sc.float()).reshape(out, -1)  # 11 + 8 bits
    return QuantizedWeight(codes, scales, -32 * scales, 8, 16, "Q6_K")
