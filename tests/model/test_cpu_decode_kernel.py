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


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("head_dim", "q_heads", "kv_heads"),
    [(64, 9, 3), (128, 8, 4), (64, 4, 4), (64, 8, 2), (64, 16, 2), (16, 4, 2)],
)
def test_prefill_spans_as_query_tiles_match_each_rows_decode(
    pool_dtype: torch.dtype, head_dim: int, q_heads: int, kv_heads: int
) -> None:
    """Rows of one request's chunk (consecutive, one key more each, the same block table)
    run as query tiles; each row must equal its own decode over its causal prefix. Spans of
    1-41 rows behind cached prefixes of 0-70 keys, beside plain decodes; a second request
    whose length happens to continue the first's (another table) must not join its tile.
    The pool tail past each request's keys is NaN: no row may read it."""
    kernel = paged_decode_kernel()
    assert kernel is not None
    block_size = 16
    gen = torch.Generator().manual_seed(head_dim * 7 + q_heads)
    # (cached prefix, rows this step) per request; a decode is (prefix, 1).
    spans = [(0, 41), (30, 1), (70, 9), (0, 2), (5, 17), (22, 1), (23, 3), (0, 1)]
    longest = max(prefix + n for prefix, n in spans)
    max_blocks = -(-longest // block_size)
    num_blocks = len(spans) * max_blocks + 3
    k_pool_t = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=gen)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)[: len(spans) * max_blocks]
    request_tables = order.view(len(spans), max_blocks)
    for r, (prefix, n) in enumerate(spans):  # NaN past each request's keys
        for pos in range(prefix + n, max_blocks * block_size):
            block = request_tables[r, pos // block_size]
            k_pool_t[block, :, :, pos % block_size] = float("nan")
            v_pool[block, pos % block_size] = float("nan")
    rows, lens = [], []
    for r, (prefix, n) in enumerate(spans):
        rows += [r] * n
        lens += [prefix + i + 1 for i in range(n)]
    tables = request_tables[rows].contiguous()
    lens_t = torch.tensor(lens)
    q = torch.randn(len(rows), q_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    k_pool_t, v_pool = k_pool_t.to(pool_dtype), v_pool.to(pool_dtype)
    got = kernel(q, k_pool_t, v_pool, tables, lens_t, scale)
    want = reference(q, k_pool_t.float(), v_pool.float(), tables, lens_t, scale)
    assert torch.isfinite(got).all()
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


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "head_dim", "block_size"), [(3, 64, 16), (2, 16, 8)])
def test_write_kv_matches_indexed_stores(
    kv_heads: int, head_dim: int, block_size: int, pool_dtype: torch.dtype
) -> None:
    """The kernel's one-pass store equals torch's indexed stores (and, into bfloat16 pools,
    torch's rounding cast) into both layouts, keys and values taken as strided views of one
    fused projection (as the decoder passes them)."""
    kernel = paged_decode_kernel()
    assert kernel is not None
    gen = torch.Generator().manual_seed(kv_heads * 7 + head_dim)
    num_blocks, width = 9, kv_heads * head_dim
    k_pool = torch.randn(num_blocks, kv_heads, head_dim, block_size, generator=gen)
    v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    k_pool, v_pool = k_pool.to(pool_dtype), v_pool.to(pool_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:23].contiguous()
    fused = torch.randn(23, 3 * width, generator=gen) * 7  # most values need rounding
    key = fused[:, width : 2 * width].view(23, kv_heads, head_dim)
    value = fused[:, 2 * width :].view(23, kv_heads, head_dim)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    want_v.view(-1, kv_heads, head_dim).index_copy_(0, slots, value.to(pool_dtype))
    want_k[slots // block_size, :, :, slots % block_size] = key.to(pool_dtype)
    assert kernel.write_kv(k_pool, v_pool, key, value, slots)
    assert torch.equal(k_pool, want_k)
    assert torch.equal(v_pool, want_v)


def test_write_kv_declines_what_it_cannot_store() -> None:
    """Rows that are not float32, pools of mixed or other dtypes and non-row-contiguous keys
    are left to torch (False, nothing written)."""
    kernel = paged_decode_kernel()
    assert kernel is not None
    k_pool = torch.zeros(2, 1, 4, 4, dtype=torch.bfloat16)
    v_pool = torch.zeros(2, 4, 1, 4, dtype=torch.bfloat16)
    key = torch.ones(3, 1, 4)
    slots = torch.tensor([0, 5, 6])
    assert not kernel.write_kv(k_pool, v_pool, key.bfloat16(), key.bfloat16(), slots)
    assert not kernel.write_kv(k_pool, v_pool.float(), key, key, slots)
    assert not kernel.write_kv(k_pool.half(), v_pool.half(), key, key, slots)
    assert not k_pool.any()
    k32, v32 = k_pool.float(), v_pool.float()
    strided = torch.ones(3, 1, 8)[:, :, ::2]
    assert not kernel.write_kv(k32, v32, strided, strided, slots)
    assert not k32.any()
