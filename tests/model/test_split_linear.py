"""`split_linear` and `PackedLinear` equal `F.linear` (up to summation order) on every path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.models.packed_linear import PackedLinear
from tandem.models.split_linear import SPLIT_MAX_ROWS, split_linear


@pytest.mark.parametrize("rows", [1, 2, 7, 64, SPLIT_MAX_ROWS, SPLIT_MAX_ROWS + 1])
@pytest.mark.parametrize("out_features", [96, 97])  # 97: two threads do not divide it
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(rows: int, out_features: int, with_bias: bool, two_threads) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, 48, generator=gen)
    weight = torch.randn(out_features, 48, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    got = split_linear(x, weight, bias)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_split_rows_land_in_the_right_columns(two_threads) -> None:
    """A weight whose halves differ: a transposed split would swap output columns."""
    weight = torch.cat([torch.eye(4), 2 * torch.eye(4)])  # [8, 4]
    x = torch.arange(8, dtype=torch.float32).view(2, 4)
    expected = torch.cat([x, 2 * x], dim=1)
    torch.testing.assert_close(split_linear(x, weight), expected)


@pytest.mark.parametrize("rows", [1, 2, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool, two_threads) -> None:
    gen = torch.Generator().manual_seed(rows + 11)
    weight = torch.randn(96, 48, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 48, generator=gen)
    layer = PackedLinear(weight, bias)
    assert layer.packed is not None, "oneDNN is part of the CPU torch build tandem pins"
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_packed_linear_falls_back_without_onednn() -> None:
    """float64 is not packed: the plain weight and `split_linear` serve every row count."""
    weight = torch.randn(8, 4, dtype=torch.float64)
    layer = PackedLinear(weight, keep_weight_for_gemv=False)
    assert layer.packed is None and layer.weight is not None
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, weight))
