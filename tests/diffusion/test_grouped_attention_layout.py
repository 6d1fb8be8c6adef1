"""The grouped canvas attention equals plain per-row GQA attention, also when SDPA hands
back its output in another memory layout (as CUDA's flash and memory-efficient kernels
do): the result is reshaped, never viewed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.models import diffusion_gemma_attention
from tandem.models.diffusion_gemma_attention import grouped_decoder_attention

ROWS, LENGTH, HEADS, KV_HEADS, DIM, CONTEXT = 3, 5, 4, 2, 8, 7


def reference(query, key, value, k_buf, v_buf, valid):  # noqa: ANN001, ANN201
    """Per row: context then canvas keys, query heads repeated over KV heads, masked SDPA."""
    outs = []
    group = HEADS // KV_HEADS
    for r in range(ROWS):
        keys = torch.cat([k_buf[r, :, :CONTEXT], key[r].transpose(0, 1)], dim=1)
        values = torch.cat([v_buf[r, :, :CONTEXT], value[r].transpose(0, 1)], dim=1)
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        out = F.scaled_dot_product_attention(
            query[r].transpose(0, 1), keys, values, attn_mask=valid[r][None, None, :], scale=1.0
        )
        outs.append(out.transpose(0, 1))
    return torch.stack(outs)


def _transposed_layout(sdpa):  # noqa: ANN001, ANN202
    """SDPA with the same values, stored `[R, L, H, D]` underneath (not viewable back)."""

    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    return run


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_grouped_attention_equals_per_row_gqa(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(ROWS, LENGTH, HEADS, DIM, generator=gen)
    key = torch.randn(ROWS, LENGTH, KV_HEADS, DIM, generator=gen)
    value = torch.randn(ROWS, LENGTH, KV_HEADS, DIM, generator=gen)
    k_buf = torch.randn(ROWS, KV_HEADS, CONTEXT + LENGTH, DIM, generator=gen)
    v_buf = torch.randn(ROWS, KV_HEADS, CONTEXT + LENGTH, DIM, generator=gen)
    valid = torch.ones(ROWS, CONTEXT + LENGTH, dtype=torch.bool)
    valid[0, :3] = False  # a shorter context in row 0
    expected = reference(query, key, value, k_buf.clone(), v_buf.clone(), valid)
    if layout == "transposed":
        monkeypatch.setattr(
            diffusion_gemma_attention.F,
            "scaled_dot_product_attention",
            _transposed_layout(F.scaled_dot_product_attention),
        )
    got = grouped_decoder_attention(query, key, value, k_buf, v_buf, valid)
    assert got.shape == (ROWS, LENGTH, HEADS, DIM)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
