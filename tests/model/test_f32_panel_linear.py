"""`F32PanelLinear`: the compiled fp32 panel GEMM against float64 products.

Row counts around the 6-row tile (1, 3, 6, 7, 64, 130), output widths around the 16-column
panel (16, 17, 1000) and odd depths (33, 577); packing exact (`dense_weight`); the portable
tile, the thread split and the torch fallback give the same numbers.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tandem.core.worker import f32_panel_linear
from tandem.core.worker.f32_panel_linear import F32PanelLinear, f32_gemm_kernel

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="needs a C++ compiler"
)

ROWS = [1, 3, 6, 7, 64, 130]
OUT_IN = [(16, 576), (17, 33), (1000, 577)]


def close_to_reference(
    y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """`y` within float32 rounding of `x @ W.T + bias` computed in float64 (per element,
    relative to the magnitude sum `|x| @ |W|.T + |bias|`)."""
    w = weight.double()
    ref = x.double() @ w.T
    scale = x.double().abs() @ w.abs().T
    if bias is not None:
        ref += bias.double()
        scale += bias.double().abs()
    assert y.dtype == torch.float32 and y.shape == ref.shape
    excess = (y.double() - ref).abs() - 1e-5 * scale - 1e-30
    assert excess.max().item() <= 0, f"worst excess {excess.max().item()}"


@pytest.fixture
def two_threads():  # noqa: ANN201
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_kernel_builds_vectorised() -> None:
    kernel = f32_gemm_kernel()
    assert kernel is not None and f32_panel_linear.available()
    assert kernel.vectorized


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), OUT_IN)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_product(
    rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1009 + out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    layer = F32PanelLinear(weight, bias)
    assert layer.packed is not None and layer.weight is None
    assert layer.packed.dtype == torch.float32
    assert layer.packed.shape == (-(-out_features // 16), in_features, 16)
    close_to_reference(layer(x), x, weight, bias)
    close_to_reference(layer.run(x, portable=True), x, weight, bias)


@pytest.mark.parametrize(("rows", "out_features"), [(64, 1000), (130, 16), (1, 17)])
def test_two_threads(rows: int, out_features: int, two_threads) -> None:
    """Panels split between threads (rows too when panels are fewer than threads)."""
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, 577, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, 577, generator=gen)
    close_to_reference(F32PanelLinear(weight, bias)(x), x, weight, bias)


def test_deep_k_is_blocked() -> None:
    """k above the kernel's depth limit (6144) takes several k blocks (partial sums)."""
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(33, 6200, generator=gen)
    x = torch.randn(7, 6200, generator=gen)
    close_to_reference(F32PanelLinear(weight)(x), x, weight, None)


def test_dense_weight_exact() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 29, generator=gen) * 1e3
    weight[0, :4] = torch.tensor([float("inf"), -0.0, 1e-40, float("nan")])
    unpacked = F32PanelLinear(weight).dense_weight()
    assert unpacked.shape == weight.shape
    assert torch.equal(unpacked.view(torch.int32), weight.view(torch.int32))
    half = torch.randn(18, 7, generator=gen).half()
    assert torch.equal(F32PanelLinear(half).dense_weight(), half.float())


def test_strided_and_empty_inputs() -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 33, generator=gen)
    layer = F32PanelLinear(weight)
    wide = torch.randn(9, 50, generator=gen)
    x = wide[:, 3:36]  # row stride 50: read in place
    close_to_reference(layer(x), x, weight, None)
    x_t = torch.randn(33, 9, generator=gen).T  # column-major: copied first
    close_to_reference(layer(x_t), x_t, weight, None)
    assert layer(torch.empty(0, 33)).shape == (0, 40)
    with pytest.raises(ValueError, match="float32"):
        layer(x.double())


def test_fallback_without_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """No kernel: the float32 weight itself, F.linear, the same numbers."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(100, 70, generator=gen)
    bias = torch.randn(100, generator=gen)
    x = torch.randn(5, 70, generator=gen)
    fast = F32PanelLinear(weight, bias)
    monkeypatch.setattr(f32_panel_linear, "f32_gemm_kernel", lambda: None)
    slow = F32PanelLinear(weight, bias)
    assert slow.packed is None and slow.weight is not None
    assert slow.weight.data_ptr() == weight.data_ptr()  # the same storage, no copy
    assert torch.equal(slow.dense_weight(), fast.dense_weight())
    close_to_reference(slow(x), x, weight, bias)
    torch.testing.assert_close(slow(x), fast(x), atol=1e-5, rtol=1e-5)


def test_kernels_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    assert f32_gemm_kernel.__wrapped__() is None
