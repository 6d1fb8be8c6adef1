"""Weight-only quantized linears on the CPU: int8 / int4 codes in 16-column panels.

`QuantLinear(weight: QuantizedWeight, bias)` computes `y = x @ W.T + bias` for float32
`x [rows, in]`, W dequantized on the fly (float32 products and accumulation) by the panel
GEMM kernel's quantized path (`csrc/panel_gemm.cpp`, "Quantized weights"): up to 4 rows
(AVX2) or 32 rows (AVX-512, tiles of 8) each 16-weight k row is widened in registers;
above, each panel is dequantized once into a float32 panel and the float32 register tiles
run over all rows: with AVX-512 the wide 6 x 48 tile over three panels, or the narrow one
where that measured faster (`choose_wide_tile`).

Contract: every weight the kernel multiplies is bit for bit `weight.dequantize()` (see
`quantized_weight`), so `layer(x)` equals `x @ dense_weight().T + bias` up to float32
summation order. Without the kernel (no compiler, `TANDEM_CPU_KERNELS=0`) the layer keeps
the dequantized float32 weight and calls `F.linear` (the same numbers, none of the memory
saving; one warning says so). torch's own CPU kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) were measured 5-57x slower than float32 `F.linear` on this
project's shapes on AVX2 (`python benchmarks/quant_linear.py`), so they are not used.

Memory: codes (1 byte per weight for int8, half for int4) plus scales (and mins) per group
of inputs and column: fp16 where every value is one (GGUF's Q4_0/Q4_1/Q8_0 and the
load-time formats, whose scales are fp16 by construction), else float32 (GGUF's K-quants,
whose scales `d * sc` are not fp16 values): Q4_K 0.75 bytes a weight (int4, groups of 32),
Q6_K 1.5 (8-bit codes, groups of 16).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.models.cpu_features import cpu_flags, cpu_vendor
from tandem.models.panel_linear import PANEL, PanelGemmKernel, panel_gemm_kernel
from tandem.models.quantized_weight import QuantizedWeight, quantize_int4, quantize_int8

logger = logging.getLogger("tandem.model")
_warned_fallback = False


@dataclass(frozen=True)
class LinearQuantization:
    """`model.quantization` and `model.quantization_group_size` as the model builder reads
    them (`auto` / `none` / `int8` / `int4`, see the config's field)."""

    mode: str = "none"
    group_size: int = 32

    @property
    def keeps_gguf(self) -> bool:
        """A GGUF's kept types stay quantized."""
        return self.mode == "auto"

    @property
    def at_load(self) -> bool:
        """Float weights are quantized as the layers are built."""
        return self.mode in ("int8", "int4")

    def quantize(self, weight: torch.Tensor) -> QuantizedWeight:
        """A layer's weight in the configured format (group size 0: per output channel)."""
        if self.mode == "int4":
            return quantize_int4(weight, self.group_size)
        return quantize_int8(weight, self.group_size or None)

    def quantize_head(self, weight: torch.Tensor) -> QuantizedWeight:
        """The LM head: int8 in both modes, in the configured groups (its logits rank every
        token; int4 there costs more agreement than it saves time, docs/quantization.md)."""
        return quantize_int8(weight, self.group_size or None)


def _panels(per_row: torch.Tensor) -> torch.Tensor:
    """`[out, ...]` -> `[ceil(out / 16), ..., 16]`, rows past `out` zero."""
    out = per_row.shape[0]
    panels = -(-out // PANEL)
    padded = per_row.new_zeros((panels * PANEL, *per_row.shape[1:]))
    padded[:out] = per_row
    moved = padded.view(panels, PANEL, *per_row.shape[1:]).movedim(1, -1)
    return moved.contiguous()


#: Rows packed at a time (a multiple of the panel width): bounds the temporaries of
#: `pack_codes` (about 3 bytes a code) whatever the weight's size.
PACK_BLOCK_ROWS = 1024


def pack_codes(weight: QuantizedWeight) -> torch.Tensor:
    """The kernel's code layout: `[panels, ceil(in / c), 16]` 32-bit words (int32 holding
    uint32 bits), c = 32 / bits codes per word; word (p, w, col) holds the codes of column
    p * 16 + col for inputs w * c .. w * c + c - 1, code j in bits [bits * j, bits * (j + 1))
    (inputs past the end: zero)."""
    out, inn = weight.codes.shape
    per = 32 // weight.bits
    packed = torch.empty((-(-out // PANEL), -(-inn // per), PANEL), dtype=torch.int32)
    for start in range(0, out, PACK_BLOCK_ROWS):
        block = _pack_block(weight.codes[start : start + PACK_BLOCK_ROWS], weight.bits)
        first = start // PANEL
        packed[first : first + block.shape[0]] = block
    return packed


def _pack_block(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack_codes` of a block of rows (`[rows, in]` uint8 codes of 4 or 8 bits), in bytes
    only: a word's four bytes are its codes 0-3 (8 bits) or the nibble pairs (2b, 2b + 1)
    (4 bits, code 2b low), little-endian, so the `[..., 4]` uint8 array viewed as int32 is
    the word."""
    per = 32 // bits
    codes = _panels(rows)  # [panels, in, 16]
    panels, inn, _ = codes.shape
    words = -(-inn // per)
    padded = codes.new_zeros((panels, words * per, PANEL))
    padded[:, :inn] = codes
    del codes
    lanes = padded.view(panels, words, per, PANEL).transpose(2, 3)  # [p, w, 16, per]
    word_bytes = lanes[..., 0::2] | (lanes[..., 1::2] << 4) if bits == 4 else lanes
    return word_bytes.contiguous().view(torch.int32).view(panels, words, PANEL)


def unpack_codes(words: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """`[..., ceil(in / c)]` words -> `[..., in]` uint8 codes (the inverse of `pack_codes`
    for one column's words)."""
    per = 32 // bits
    values = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    codes = (values[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :in_features].to(torch.uint8)


def _fp16_exact(values: torch.Tensor) -> bool:
    """Every value survives a round trip through float16 bit for bit."""
    return bool(torch.equal(values.half().float(), values))


#: `TANDEM_Q_WIDE_TILE=1` / `0` forces the choice (A/B runs); unset: `wide_tile_preferred`.
WIDE_TILE_ENV = "TANDEM_Q_WIDE_TILE"
_wide_tile: bool | None = None


def wide_tile_preferred(flags: frozenset[str], vendor: str) -> bool:
    """Whether products above 32 rows should take the wide AVX-512 tile on a CPU with these
    flags and `vendor_id`: on an Intel Xeon (Sapphire Rapids, two 512-bit FMA units) it took
    SmolLM2's Q4_1 layers at 64 sequences from 0.88x to 1.06x float32's tokens/s; on an AMD
    EPYC (Zen 4, which runs a zmm FMA as two 256-bit halves) it took 1.10-1.40x oneDNN's
    time at 64-2048 rows against the narrow tile's 1.00-1.20x. No AVX-512: no wide tile.
    Measured on those two CPUs only; a timing at load was too noisy on a busy 2-core
    machine (the choice flipped between runs)."""
    return "avx512f" in flags and vendor != "AuthenticAMD"


def choose_wide_tile(kernel: PanelGemmKernel) -> bool:
    """Set the kernel's process-wide choice for products above 32 rows, once per process:
    `TANDEM_Q_WIDE_TILE` when set, else `wide_tile_preferred` on this CPU. Returns it."""
    global _wide_tile
    if _wide_tile is None:
        forced = os.environ.get(WIDE_TILE_ENV, "").strip()
        if forced in ("0", "1"):
            _wide_tile = forced == "1"
        else:
            _wide_tile = wide_tile_preferred(cpu_flags(), cpu_vendor())
        kernel.q_gemm_set_wide(int(_wide_tile))
    return _wide_tile


class QuantLinear:
    """A float32-in, float32-out linear over a `QuantizedWeight` (see the module
    docstring). `kind` names the format (`"Q4_1"`, `"int8"`, ...). The first layer built
    in a process sets the kernel's wide-tile choice (`choose_wide_tile`)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size, self.kind = weight.bits, weight.group_size, weight.kind
        self.bias = bias.detach().float().contiguous().clone() if bias is not None else None
        self._kernel: PanelGemmKernel | None = panel_gemm_kernel()
        if self._kernel is not None:
            choose_wide_tile(self._kernel)
        self.codes: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.mins: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self.half_scales = False
        if self._kernel is None:
            _warn_fallback()
            self.weight = weight.dequantize()
            return
        per = 32 // weight.bits
        groups = -(-self.in_features // weight.group_size)
        if weight.group_size % per and groups > 1:
            raise ValueError(
                f"QuantLinear: groups of {weight.group_size} inputs do not hold whole "
                f"{per}-code words of {weight.bits}-bit codes"
            )
        self.codes = pack_codes(weight)
        scales = weight.scales.float()
        mins = weight.mins.float() if weight.mins is not None else None
        #: Scales and mins held as fp16 when every value is one (GGUF's Q4_0/Q4_1/Q8_0,
        #: load-time int8/int4): 2 bytes a group instead of 4, read by the kernel exactly.
        self.half_scales = _fp16_exact(scales) and (mins is None or _fp16_exact(mins))
        held = torch.float16 if self.half_scales else torch.float32
        self.scales = _panels(scales.to(held))
        self.mins = _panels(mins.to(held)) if mins is not None else None

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds for its weight (codes, scales, mins; or the float copy)."""
        held = (self.codes, self.scales, self.mins, self.weight)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"QuantLinear({self.in_features}->{self.out_features}) takes float32 "
                f"[rows, {self.in_features}], got {x.dtype} {tuple(x.shape)}"
            )
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        return self.run(x)

    def run(self, x: torch.Tensor, portable: bool = False) -> torch.Tensor:
        """The kernel's product (`portable`: its plain loops, for tests)."""
        assert self._kernel is not None and self.codes is not None and self.scales is not None
        rows = x.shape[0]
        if x.stride(1) != 1 or (rows > 1 and x.stride(0) < self.in_features):
            x = x.contiguous()
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        self._kernel.q_gemm(
            x.data_ptr(),
            x.stride(0),
            self.codes.data_ptr(),
            self.scales.data_ptr(),
            self.mins.data_ptr() if self.mins is not None else None,
            self.bias.data_ptr() if self.bias is not None else None,
            y.data_ptr(),
            self.out_features,
            rows,
            self.out_features,
            self.in_features,
            self.group_size,
            self.bits,
            int(self.half_scales),
            torch.get_num_threads(),
            int(portable),
        )
        return y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized weight, float32 `[len(ids), in]` (an embedding
        lookup over a tied table; a drafter's LM-head rows), exact."""
        if self.weight is not None:
            return self.weight[ids]
        assert self.codes is not None and self.scales is not None
        ids = ids.to(torch.long)
        panel, col = ids // PANEL, ids % PANEL
        values = unpack_codes(self.codes[panel, :, col], self.bits, self.in_features).float()
        scales = self.scales[panel, :, col].float().repeat_interleave(self.group_size, dim=1)
        product = scales[:, : self.in_features] * values
        if self.mins is None:
            return product
        mins = self.mins[panel, :, col].float().repeat_interleave(self.group_size, dim=1)
        return product + mins[:, : self.in_features]

    def dense_weight(self) -> torch.Tensor:
        """The whole dequantized `[out, in]` float32 weight (new memory; exact)."""
        if self.weight is not None:
            return self.weight
        return self.rows(torch.arange(self.out_features))


class QuantEmbedding(torch.nn.Module):
    """An embedding lookup over a `QuantLinear`'s rows (a GGUF table kept quantized, tied to
    the LM head or not): float32 `[..., hidden]`, exact dequantized rows."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        #: Shape and dtype only (a meta tensor): what code that inspects an embedding's
        #: weight (its dtype, its size) reads; the values are `table`'s.
        self.weight = torch.empty(
            (self.num_embeddings, self.embedding_dim), dtype=dtype, device="meta"
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = self.table.rows(input_ids.reshape(-1))
        return flat.view(*input_ids.shape, self.embedding_dim)


def _warn_fallback() -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        logger.warning(
            "quantized linears: the compiled kernel is unavailable; weights are held "
            "dequantized in float32 (no memory saving)"
        )
