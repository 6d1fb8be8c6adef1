"""The quantized GEMM's code paths agree: the register (decode) tiles, including the
AVX-512 tile that sums codes against x per group and scales once per group (up to 8 rows,
and in blocks of 8 up to 32 rows), the panel path (above, across row blocks of 96), and the
portable loops; scales and mins held as fp16 (when every value is one) or float32.

Each case is checked against a float64 product with the dequantized weight, and identity
rows read each weight back exactly as `dequantize()` gives it."""

from __future__ import annotations

import pytest
import torch

from tandem.models.panel_linear import available
from tandem.models.quant_linear import QuantLinear
from tandem.models.quantized_weight import QuantizedWeight, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not available(), reason="needs the compiled panel kernel")


def _weight(kind: str, n: int, k: int) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * 1000 + k))
    if kind == "int4-g32":
        return quantize_int4(w, 32)
    if kind == "int4-g64":
        return quantize_int4(w, 64)
    if kind == "int8-g32":
        return quantize_int8(w, 32)
    return quantize_int8(w)  # per channel: one group of all k


def _float32_scales(weight: QuantizedWeight) -> QuantizedWeight:
    """The same codes with scales and mins that are not fp16 values (below fp16's normal
    range, so held as float32) but keep 11 significant bits: scale * code stays exact in
    float32, as with Q4_K's 17-bit scales."""
    tiny = 2.0**-30
    mins = weight.mins * tiny if weight.mins is not None else None
    return QuantizedWeight(
        weight.codes, weight.scales * tiny, mins, weight.bits, weight.group_size, weight.kind
    )


@pytest.mark.parametrize("kind", ["int4-g32", "int4-g64", "int8-g32", "int8-channel"])
@pytest.mark.parametrize("scales", ["fp16", "float32"])
@pytest.mark.parametrize("n,k", [(40, 64), (100, 576), (16, 200)])
def test_every_path_matches_the_dequantized_product(kind: str, scales: str, n: int, k: int) -> None:
    weight = _weight(kind, n, k)
    if scales == "float32":
        weight = _float32_scales(weight)
    bias = torch.randn(n)
    layer = QuantLinear(weight, bias)
    assert layer.half_scales == (scales == "fp16")
    dense = weight.dequantize().double()
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 32, 33, 48, 100, 197):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        reference = x.double() @ dense.T + bias.double()
        for portable in (False, True):
            y = layer.run(x, portable=portable).double()
            error = (y - reference).abs().max() / reference.abs().max()
            assert error < 1e-5, (rows, portable, float(error))


@pytest.mark.parametrize("kind", ["int4-g32", "int8-g32", "int8-channel"])
@pytest.mark.parametrize("scales", ["fp16", "float32"])
def test_identity_rows_read_back_each_dequantized_weight_exactly(kind: str, scales: str) -> None:
    weight = _weight(kind, 56, 96)
    if scales == "float32":
        weight = _float32_scales(weight)
    layer = QuantLinear(weight)
    dense = weight.dequantize()
    # register tiles (one, blocks of 8 and a remainder) and the panel path (past 32 rows;
    # 130 rows: two row blocks, a partial tile)
    eyes = torch.cat([torch.eye(96), torch.eye(96)])
    for start, rows in ((0, 1), (5, 4), (0, 8), (40, 9), (3, 29), (50, 33), (7, 130)):
        eye = eyes[start : start + rows]
        assert torch.equal(layer.run(eye), eyes[start : start + rows] @ dense.T)


def test_fp16_scales_halve_the_scale_bytes() -> None:
    weight = _weight("int4-g32", 64, 128)
    half, full = QuantLinear(weight), QuantLinear(_float32_scales(weight))
    assert half.half_scales and not full.half_scales
    groups_bytes = 64 * (128 // 32) * 2  # scales and mins, one per group and column
    assert full.nbytes - half.nbytes == groups_bytes * 2  # 4 bytes -> 2 bytes each
    rows = torch.tensor([0, 17, 63])
    assert torch.equal(half.rows(rows), weight.dequantize()[rows])


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_words_hold_each_code_at_its_bit_position(bits: int) -> None:
    """`pack_codes` against its contract written out with Python integers: word (p, w, col)
    holds code j of column p * 16 + col, input w * c + j, in bits [bits * j, bits * (j + 1))
    (the top code's high bit is bit 31: int32 holds the uint32 bits); rows and inputs past
    the end are zero. 37 rows and 75 inputs: a partial panel and a partial word."""
    from tandem.models.quant_linear import PANEL, pack_codes

    generator = torch.Generator().manual_seed(bits)
    out, inn, per = 37, 75 if bits == 8 else 74, 32 // bits
    codes = torch.randint(0, 1 << bits, (out, inn), generator=generator, dtype=torch.uint8)
    codes[0, :per] = (1 << bits) - 1  # a word with bit 31 set
    scales = torch.ones(out, 1)
    packed = pack_codes(QuantizedWeight(codes, scales, None, bits, inn, "test"))
    words = -(-inn // per)
    assert packed.shape == (-(-out // PANEL), words, PANEL)
    for p in range(packed.shape[0]):
        for w in range(words):
            for col in range(PANEL):
                row, expected = p * PANEL + col, 0
                for j in range(per):
                    i = w * per + j
                    if row < out and i < inn:
                        expected |= int(codes[row, i]) << (bits * j)
                assert int(packed[p, w, col]) & 0xFFFFFFFF == expected


@pytest.mark.parametrize("wide", [True, False])
def test_both_tiles_above_32_rows_match_the_dequantized_product(wide: bool) -> None:
    """Products of more than 32 rows on the wide AVX-512 tile and on the narrow one (the
    process-wide switch `choose_wide_tile` sets; a no-op without AVX-512): 3, 7 and 1
    panels, full and partial six-row tiles, fp16 and float32 scales."""
    from tandem.models.panel_linear import panel_gemm_kernel

    kernel = panel_gemm_kernel()
    assert kernel is not None
    previous = kernel.q_gemm_set_wide(int(wide))
    try:
        for n, k in [(40, 64), (100, 576), (16, 200)]:
            for weight in (_weight("int4-g32", n, k), _float32_scales(_weight("int8-g32", n, k))):
                bias = torch.randn(n)
                layer = QuantLinear(weight, bias)
                dense = weight.dequantize().double()
                for rows in (33, 36, 64, 197):
                    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                    reference = x.double() @ dense.T + bias.double()
                    y = layer.run(x).double()
                    error = (y - reference).abs().max() / reference.abs().max()
                    assert error < 1e-5, (n, k, rows, float(error))
    finally:
        kernel.q_gemm_set_wide(previous)


@pytest.mark.parametrize("forced", ["0", "1"])
def test_the_wide_tile_choice_follows_the_environment(
    forced: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`TANDEM_Q_WIDE_TILE` decides without timing, and the kernel's switch is set to it."""
    from tandem.models import quant_linear
    from tandem.models.panel_linear import panel_gemm_kernel

    kernel = panel_gemm_kernel()
    assert kernel is not None
    before = kernel.q_gemm_set_wide(1)
    kernel.q_gemm_set_wide(before)
    monkeypatch.setenv(quant_linear.WIDE_TILE_ENV, forced)
    monkeypatch.setattr(quant_linear, "_wide_tile", None)
    try:
        assert quant_linear.choose_wide_tile(kernel) is (forced == "1")
        assert kernel.q_gemm_set_wide(before) == int(forced)
    finally:
        kernel.q_gemm_set_wide(before)


def test_the_wide_tile_is_preferred_on_avx512_except_amd() -> None:
    """The measured rule: Intel (and other) AVX-512 CPUs take the wide tile, AMD's (Zen 4
    measured slower with it) and CPUs without AVX-512 the narrow one."""
    from tandem.models.cpu_features import cpu_vendor
    from tandem.models.quant_linear import wide_tile_preferred

    avx512 = frozenset({"avx2", "fma", "avx512f", "avx512bw"})
    assert wide_tile_preferred(avx512, "GenuineIntel")
    assert not wide_tile_preferred(avx512, "AuthenticAMD")
    assert not wide_tile_preferred(frozenset({"avx2", "fma"}), "GenuineIntel")
    assert cpu_vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t: fpu\n") == (
        "AuthenticAMD"
    )
    assert cpu_vendor("processor\t: 0\n") == ""


def test_cpuinfo_fields_come_from_the_first_processor() -> None:
    from tandem.models.cpu_features import cpu_model_name, cpu_vendor

    cpuinfo = (
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon: Gold 6 (R)\n\n"
        "processor\t: 1\nvendor_id\t: AuthenticAMD\nmodel name\t: EPYC\n"
    )
    assert cpu_model_name(cpuinfo) == "Xeon: Gold 6 (R)"
    assert cpu_vendor(cpuinfo) == "GenuineIntel"
    assert cpu_model_name("processor\t: 0\n") == ""
