"""`F32PanelLinear` and `Bf16Linear`: the compiled panel GEMM against float64 products of
the stored weight.

Both weight formats: row counts around the 6-row tile (1, 3, 6, 7, 64, 130), output widths
around the 16-column panel (16, 17, 1000), odd depths (33, 577) and a depth past the k
block; the portable tile, the thread split and the torch fallback give the same numbers.
Packing is exact: float32 bit for bit, bf16 rounded as torch's `.bfloat16()` (ties,
denormals, infinities, NaN).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tandem.models import panel_linear
from tandem.models.panel_linear import (
    Bf16Linear,
    F32PanelLinear,
    PanelLinear,
    pack_weight,
    panel_gemm_kernel,
)

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="needs a C++ compiler"
)

LAYERS = [F32PanelLinear, Bf16Linear]
ROWS = [1, 3, 6, 7, 64, 130]
OUT_IN = [(16, 576), (17, 33), (64, 40), (1000, 577)]


def close_to_reference(
    y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """`y` within float32 rounding of `x @ W.T + bias` computed in float64 (per element,
    relative to the magnitude sum `|x| @ |W|.T + |bias|`); `weight` as stored."""
    w = weight.double()
    ref = x.double() @ w.T
    scale = x.double().abs() @ w.abs().T
    if bias is not None:
        ref += bias.double()
        scale += bias.double().abs()
    assert y.dtype == torch.float32 and y.shape == ref.shape
    excess = (y.double() - ref).abs() - 1e-5 * scale - 1e-30
    assert excess.max().item() <= 0, f"worst excess {excess.max().item()}"


def stored(layer_type: type[PanelLinear], weight: torch.Tensor) -> torch.Tensor:
    return weight.to(layer_type.weight_dtype)


def test_kernel_builds_vectorised() -> None:
    kernel = panel_gemm_kernel()
    assert kernel is not None and panel_linear.available()
    # Every CPU tandem's CI runs on has AVX2; a portable-only build would be slow.
    assert kernel.vectorized


@pytest.mark.parametrize("layer_type", LAYERS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), OUT_IN)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_product(
    layer_type: type[PanelLinear], rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1009 + out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    layer = layer_type(weight, bias)
    assert layer.packed is not None and layer.weight is None
    assert layer.packed.dtype == layer_type.weight_dtype
    assert layer.packed.shape == (-(-out_features // 16), in_features, 16)
    close_to_reference(layer(x), x, stored(layer_type, weight), bias)
    close_to_reference(layer.run(x, portable=True), x, stored(layer_type, weight), bias)


@pytest.mark.parametrize("layer_type", LAYERS)
@pytest.mark.parametrize(("rows", "out_features"), [(64, 1000), (130, 16), (1, 17)])
def test_two_threads(
    layer_type: type[PanelLinear], rows: int, out_features: int, two_threads
) -> None:
    """Panels split between threads (rows too when panels are fewer than threads)."""
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, 577, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, 577, generator=gen)
    close_to_reference(layer_type(weight, bias)(x), x, stored(layer_type, weight), bias)


@pytest.mark.parametrize("layer_type", LAYERS)
def test_deep_k_is_blocked(layer_type: type[PanelLinear]) -> None:
    """k above the kernel's depth limit (6144) takes several k blocks (partial sums)."""
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(33, 6200, generator=gen)
    x = torch.randn(7, 6200, generator=gen)
    close_to_reference(layer_type(weight)(x), x, stored(layer_type, weight), None)


@pytest.mark.parametrize("layer_type", LAYERS)
def test_strided_and_empty_inputs(layer_type: type[PanelLinear]) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 33, generator=gen)
    layer = layer_type(weight)
    wide = torch.randn(9, 50, generator=gen)
    x = wide[:, 3:36]  # row stride 50: read in place
    close_to_reference(layer(x), x, stored(layer_type, weight), None)
    x_t = torch.randn(33, 9, generator=gen).T  # column-major: copied first
    close_to_reference(layer(x_t), x_t, stored(layer_type, weight), None)
    assert layer(torch.empty(0, 33)).shape == (0, 40)
    with pytest.raises(ValueError, match=rf"{layer_type.__name__}\(33->40\) takes float32"):
        layer(x.double())


def test_f32_packing_exact() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 29, generator=gen) * 1e3
    weight[0, :4] = torch.tensor([float("inf"), -0.0, 1e-40, float("nan")])
    unpacked = F32PanelLinear(weight).dense_weight()
    assert unpacked.shape == weight.shape
    assert torch.equal(unpacked.view(torch.int32), weight.view(torch.int32))
    half = torch.randn(18, 7, generator=gen).half()
    assert torch.equal(F32PanelLinear(half).dense_weight(), half.float())


def special_floats() -> torch.Tensor:
    """Values whose rounding to bf16 is delicate: ties to even both ways, just above and
    below a tie, denormals, the overflow edge, infinities, signed zeros."""
    bits = [
        0x3F808000,  # tie, even below -> down
        0x3F818000,  # tie, odd below -> up
        0x3F808001,  # just above a tie -> up
        0x3F807FFF,  # just below a tie -> down
        0x00008000,  # denormal tie
        0x00018000,  # denormal tie, odd
        0x007FFFFF,  # largest denormal -> rounds to the smallest normal
        0x7F7FFFFF,  # largest float -> rounds to infinity
        0x7F7F7FFF,  # below the overflow edge
        0x7F800000,  # +inf
        0xFF800000,  # -inf
        0x80000000,  # -0
        0xBF818000,  # negative tie, odd
    ]
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_bf16_packing_rounds_like_torch() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 29, generator=gen) * 1e3
    specials = special_floats()
    weight.view(-1)[: specials.numel()] = specials
    expected = weight.bfloat16()
    unpacked = Bf16Linear(weight).dense_weight()
    assert torch.equal(unpacked.view(torch.int16), expected.view(torch.int16))
    nan = torch.zeros(3, 4)
    nan[1, 2] = float("nan")
    assert Bf16Linear(nan).dense_weight().float().isnan().nonzero().tolist() == [[1, 2]]


def test_bf16_and_other_sources_round_trip() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(50, 21, generator=gen).bfloat16()
    weight.view(torch.int16)[0, :3] = torch.tensor([0x7FC1, -1, 0x7F81])  # NaN payloads
    unpacked = Bf16Linear(weight).dense_weight()
    assert torch.equal(unpacked.view(torch.int16), weight.view(torch.int16))
    half = torch.randn(18, 7, generator=gen).half()
    assert torch.equal(Bf16Linear(half).dense_weight(), half.bfloat16())


def test_pack_weight_rejects_other_formats() -> None:
    kernel = panel_gemm_kernel()
    assert kernel is not None
    with pytest.raises(ValueError, match="float32 or bfloat16, got torch.float16"):
        pack_weight(kernel, torch.zeros(4, 4), torch.float16)


@pytest.mark.parametrize("layer_type", LAYERS)
def test_fallback_without_kernel(
    layer_type: type[PanelLinear], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No kernel: the plain weight in the layer's format, float32 F.linear, the same
    numbers; a weight already in that format is kept without a copy."""
    gen = torch.Generator().manual_seed(6)
    weight = stored(layer_type, torch.randn(100, 70, generator=gen))
    bias = torch.randn(100, generator=gen)
    x = torch.randn(5, 70, generator=gen)
    fast = layer_type(weight, bias)
    monkeypatch.setattr(panel_linear, "panel_gemm_kernel", lambda: None)
    slow = layer_type(weight, bias)
    assert slow.packed is None and slow.weight is not None
    assert slow.weight.data_ptr() == weight.data_ptr()
    assert torch.equal(slow.dense_weight(), fast.dense_weight())
    close_to_reference(slow(x), x, weight, bias)
    torch.testing.assert_close(slow(x), fast(x), atol=1e-5, rtol=1e-5)


def test_kernels_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    assert panel_gemm_kernel.__wrapped__() is None
