"""The CPU prefill path (fresh chunk keys + gathered prefix, two flash calls merged by
logsumexp) against the gathered-context SDPA path it replaces, and both against a
float64 reference; and the same chunks attended as decodes by the compiled kernel (contexts
up to `MAX_CONTEXT_AS_KERNEL_DECODES`) against both.

One step with fresh prefills and chunks over a cached prefix (block-aligned or not), GQA,
NaN-filled pools (an unwritten slot read by either path would show), both key layouts,
fp32 and bf16 pools, the default and an explicit scale.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch

import tandem.models.paged_attention as pa
from tandem.models.cpu_kernels import PagedDecodeKernel, paged_decode_kernel

Q_HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 8, 4
#: (cached prefix, chunk length) per request; chunks exceed MAX_SPAN_AS_DECODES. A
#: one-block prefix makes `_gather_transposed` return a view strided in its last dimension.
SPANS = ((0, 20), (13, 17), (24, 33), (0, 40), (5, 18), (4, 17))
NO_KERNEL = "no compiled decode kernel here (no C++ compiler, or TANDEM_CPU_KERNELS=0)"


class _Layer:
    layer_idx = 0


def _step(
    keys_transposed: bool,
    pool_dtype: torch.dtype,
    kernel: PagedDecodeKernel | None = None,
) -> tuple[pa.PagedAttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """Pools (NaN outside the cached prefixes), this step's q/k/v and the plan (with
    `kernel`, a real decode kernel: keys transposed)."""
    gen = torch.Generator().manual_seed(0)
    lens = [p + n for p, n in SPANS]
    blocks_per = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(SPANS), max(blocks_per), dtype=torch.int64)
    used = 0
    for r, nb in enumerate(blocks_per):
        tables[r, :nb] = perm[used : used + nb]
        used += nb
    v_pool = torch.full((num_blocks, BLOCK, KV_HEADS, DIM), float("nan"), dtype=pool_dtype)
    k_pool = torch.full_like(v_pool, float("nan"))
    # Cached prefixes: written straight into the (untransposed) pools; full K/V kept.
    full_k, full_v = [], []
    for r, (prefix, n) in enumerate(SPANS):
        k = torch.randn(prefix + n, KV_HEADS, DIM, generator=gen).to(pool_dtype)
        v = torch.randn(prefix + n, KV_HEADS, DIM, generator=gen).to(pool_dtype)
        for pos in range(prefix):
            block, off = int(tables[r, pos // BLOCK]), pos % BLOCK
            k_pool[block, off], v_pool[block, off] = k[pos], v[pos]
        full_k.append(k)
        full_v.append(v)
    if keys_transposed:
        k_pool = k_pool.permute(0, 2, 3, 1).contiguous()
    starts = [0]
    for _, n in SPANS:
        starts.append(starts[-1] + n)
    slots = torch.cat(
        [
            torch.tensor(
                [int(tables[r, pos // BLOCK]) * BLOCK + pos % BLOCK for pos in range(p, p + n)]
            )
            for r, (p, n) in enumerate(SPANS)
        ]
    )
    if kernel is None and keys_transposed:
        # No decodes in the step: the kernel is never called, it only marks the layout.
        kernel = cast(PagedDecodeKernel, object())
    meta = pa.build_metadata(
        [(k_pool, v_pool)], slots, starts, [p for p, _ in SPANS], lens, tables, BLOCK, kernel
    )
    # q as the model passes it: a `[T, Hq, D]` view of a wider fused QKV row.
    qkv = torch.randn(starts[-1], (Q_HEADS + 2 * KV_HEADS) * DIM, generator=gen)
    q = qkv[:, : Q_HEADS * DIM].view(-1, Q_HEADS, DIM).transpose(0, 1)[None]
    key = torch.cat([k[p:] for k, (p, _) in zip(full_k, SPANS, strict=True)]).float()
    value = torch.cat([v[p:] for v, (p, _) in zip(full_v, SPANS, strict=True)]).float()
    ref = _reference(q, full_k, full_v, starts)
    return meta, q, key.transpose(0, 1)[None], value.transpose(0, 1)[None], ref


def _reference(q: torch.Tensor, full_k: list, full_v: list, starts: list[int]) -> list:
    """float64 causal attention of each chunk over its whole context, default scale."""
    outs = []
    for r, (prefix, n) in enumerate(SPANS):
        qr = q[0, :, starts[r] : starts[r + 1]].double()  # [Hq, n, D]
        k = full_k[r].double().transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, 0)
        v = full_v[r].double().transpose(0, 1).repeat_interleave(Q_HEADS // KV_HEADS, 0)
        scores = qr @ k.transpose(1, 2) * DIM**-0.5  # [Hq, n, prefix + n]
        visible = torch.arange(prefix + n)[None, :] <= torch.arange(prefix, prefix + n)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append((scores.softmax(-1) @ v).transpose(0, 1))  # [n, Hq, D]
    return outs


def _run(meta: pa.PagedAttentionMetadata, q, key, value, scaling):  # noqa: ANN001, ANN202
    out, _ = pa.paged_attention(_Layer(), q, key, value, None, scaling=scaling, paged=meta)
    return out[0]


@pytest.mark.parametrize("keys_transposed", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_split_prefill_matches_gathered_sdpa(
    keys_transposed: bool,
    pool_dtype: torch.dtype,
    scaling: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if pa._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash-attention op")
    monkeypatch.setattr(pa, "MAX_CONTEXT_AS_KERNEL_DECODES", 0)  # every chunk a prefill
    meta, q, key, value, ref = _step(keys_transposed, pool_dtype)
    assert len(meta.prefills) == len(SPANS) and not meta.decode_groups
    split = _run(meta, q, key, value, scaling)
    monkeypatch.setattr(pa, "_FLASH_CPU", None)  # the gathered-context path
    gathered = _run(meta, q, key, value, scaling)
    assert not split.isnan().any()
    torch.testing.assert_close(split, gathered, atol=2e-6, rtol=1e-5)
    if scaling is None and pool_dtype == torch.float32:
        torch.testing.assert_close(split.double(), torch.cat(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_prefill_chunks_attended_as_kernel_decodes_match_the_flash_path(
    pool_dtype: torch.dtype, scaling: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip(NO_KERNEL)
    if pa._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash-attention op")
    meta, q, key, value, ref = _step(True, pool_dtype, kernel)
    # Every chunk (17-40 tokens, contexts up to 57) goes to the kernel: no prefill left.
    assert not meta.prefills and meta.decode_batch is not None
    assert meta.decode_batch.all_tokens
    as_decodes = _run(meta, q, key, value, scaling)
    monkeypatch.setattr(pa, "MAX_CONTEXT_AS_KERNEL_DECODES", 0)
    meta, q, key, value, _ = _step(True, pool_dtype, kernel)
    assert len(meta.prefills) == len(SPANS)
    flash = _run(meta, q, key, value, scaling)
    assert not as_decodes.isnan().any()
    torch.testing.assert_close(as_decodes, flash, atol=2e-6, rtol=1e-5)
    if scaling is None and pool_dtype == torch.float32:
        torch.testing.assert_close(as_decodes.double(), torch.cat(ref), atol=1e-5, rtol=1e-5)


def test_long_contexts_stay_on_the_flash_path(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip(NO_KERNEL)
    # The longest context is 57 tokens: a limit of 40 keeps it (and the 40-token chunk,
    # context 57) a prefill while the others become decodes.
    monkeypatch.setattr(pa, "MAX_CONTEXT_AS_KERNEL_DECODES", 40)
    meta, *_ = _step(True, torch.float32, kernel)
    lens = [p + n for p, n in SPANS]
    assert len(meta.prefills) == sum(n > 40 for n in lens)
    assert meta.decode_batch is not None
    assert int(meta.decode_batch.token_idx.numel()) == sum(n for p, n in SPANS if p + n <= 40)
