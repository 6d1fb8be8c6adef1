"""The compiled CPU decode kernel against SDPA on gathered contexts.

Scattered block tables, context lengths from 1 to several blocks (exact multiples
included), GQA groups 1-8, the specialised shapes (head_dim 64/128, block 16) and the
generic loop (other head dims and block sizes).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from tandem.models.cpu_kernels import paged_decode_kernel

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="needs a C++ compiler"
)


def reference(q, k_pool_t, v_pool, tables, lens, scale):  # noqa: ANN001, ANN201
    """Per request: gather the context, SDPA with GQA."""
    _, kv_heads, dim, block_size = k_pool_t.shape
    out = torch.empty_like(q)
    for r in range(q.shape[0]):
        length = int(lens[r])
        blocks = tables[r, : -(-length // block_size)]
        k = k_pool_t[blocks].permute(1, 0, 3, 2).reshape(kv_heads, -1, dim)[:, :length]
        v = v_pool[blocks].reshape(-1, kv_heads, dim)[:length].transpose(0, 1)
        out[r] = F.scaled_dot_product_attention(
            q[r][None, :, None], k[None], v[None], scale=scale, enable_gqa=True
        )[0, :, 0]
    return out


@pytest.mark.parametrize(
    ("head_dim", "q_heads", "kv_heads", "block_size"),
    [
        (64, 9, 3, 16),  # SmolLM2's shape: specialised path
        (128, 8, 1, 16),  # group of 8
        (128, 4, 4, 16),  # no GQA
        (64, 14, 2, 16),  # group of 7
        (16, 4, 2, 16),  # generic head_dim
        (64, 6, 2, 8),  # generic block size
        (32, 12, 1, 4),  # generic, group of 12 (beyond the specialised range)
    ],
)
def test_kernel_matches_sdpa(head_dim: int, q_heads: int, kv_heads: int, block_size: int) -> None:
    kernel = paged_decode_kernel()
    assert kernel is not None, "a compiler is present, so the kernel must build"
    gen = torch.Generator().manual_seed(head_dim * 131 + q_heads)
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size, 77, 200, 5, 129])
    max_blocks = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * max_blocks + 7
    k_pool_t = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=gen)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks]
    tables = tables.view(len(lens), max_blocks).contiguous()
    q = torch.randn(len(lens), q_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    got = kernel(q, k_pool_t, v_pool, tables, lens, scale)
    want = reference(q, k_pool_t, v_pool, tables, lens, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_kernel_with_no_requests() -> None:
    kernel = paged_decode_kernel()
    assert kernel is not None
    pool = torch.zeros(2, 1, 64, 16)
    out = kernel(
        torch.zeros(0, 2, 64),
        pool,
        torch.zeros(2, 16, 1, 64),
        torch.zeros(0, 1, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        0.125,
    )
    assert out.shape == (0, 2, 64)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    paged_decode_kernel.cache_clear()
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    try:
        assert paged_decode_kernel() is None
    finally:
        paged_decode_kernel.cache_clear()
