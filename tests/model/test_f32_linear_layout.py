"""`model.f32_linear`: the float32 linear layout a worker builds (`models/linear_choice.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from tandem.models import linear_choice, panel_linear
from tandem.models.cpu_features import cpu_flags
from tandem.models.linear_choice import DUAL_ROWS, RowDispatchLinear, cpu_f32_linear
from tandem.models.packed_linear import onednn_usable


@pytest.fixture
def restore_mode() -> Iterator[None]:
    before = linear_choice._f32_mode
    yield
    linear_choice._f32_mode = before


def test_auto_is_dual_only_with_avx512_and_a_small_checkpoint(restore_mode: None) -> None:
    wide = "avx512f" in cpu_flags()
    assert linear_choice.configure("auto", 1 << 20) == ("dual" if wide else "panel")
    assert linear_choice.configure("auto", linear_choice.DUAL_AUTO_MAX_BYTES + 1) == "panel"
    assert linear_choice.configure("panel", 1 << 20) == "panel"


@pytest.mark.skipif(
    not panel_linear.available() or not onednn_usable(torch.zeros(1)),
    reason="the dual layout needs both kernels, and this machine lacks one: the panel kernel "
    "(built by a C++ compiler) or torch's oneDNN (mkldnn)",
)
def test_dual_dispatches_by_rows_and_equals_the_product(
    restore_mode: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TANDEM_F32_LINEAR", raising=False)
    linear_choice.configure("dual", 0)
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    layer = cpu_f32_linear(weight, bias)
    assert isinstance(layer, RowDispatchLinear)
    assert torch.equal(layer.dense_weight(), weight)
    calls: list[str] = []
    small, large = layer.small, layer.large
    layer.small = lambda x: calls.append("panel") or small(x)  # type: ignore[assignment]
    layer.large = lambda x: calls.append("onednn") or large(x)  # type: ignore[assignment]
    for rows in (1, DUAL_ROWS, DUAL_ROWS + 1, 64):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert calls == ["panel", "panel", "onednn", "onednn"]
    assert cpu_f32_linear(weight, bias, prefill_copy=False).__class__.__name__ == "F32PanelLinear"
