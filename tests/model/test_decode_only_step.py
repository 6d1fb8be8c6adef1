"""A decode-only step hands the CPU decode kernel the whole query and returns its output
as the step's (`DecodeBatch.all_tokens`), with no row gather or scatter: the same values as
the general path, which a step mixing a prefill chunk with decodes still takes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.models import paged_attention as pa
from tandem.models.cpu_kernels import paged_decode_kernel

KERNEL = paged_decode_kernel()
BLOCK, KV_HEADS, Q_HEADS, DIM = 16, 2, 4, 64


class _Layer:
    layer_idx = 0


def _step(query_lens: list[int], seq_lens: list[int]) -> tuple[pa.PagedAttentionMetadata, ...]:
    gen = torch.Generator().manual_seed(sum(seq_lens))
    blocks = 16
    k_pool = torch.randn(blocks, KV_HEADS, DIM, BLOCK, generator=gen)
    v_pool = torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:4] for _ in seq_lens])
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    positions = [s - n for s, n in zip(seq_lens, query_lens, strict=True)]
    slots = torch.tensor(
        [
            int(tables[r, pos // BLOCK]) * BLOCK + pos % BLOCK
            for r, (p, n) in enumerate(zip(positions, query_lens, strict=True))
            for pos in range(p, p + n)
        ]
    )
    meta = pa.build_metadata(
        [(k_pool, v_pool)], slots, starts, positions, seq_lens, tables, BLOCK, KERNEL
    )
    return meta, torch.randn(starts[-1], (Q_HEADS + 2 * KV_HEADS) * DIM, generator=gen)


def _attend(meta: pa.PagedAttentionMetadata, qkv: torch.Tensor) -> torch.Tensor:
    tokens = qkv.shape[0]
    q = qkv[:, : Q_HEADS * DIM].view(tokens, Q_HEADS, DIM)
    k = qkv[:, Q_HEADS * DIM : (Q_HEADS + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
    v = qkv[:, (Q_HEADS + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)
    out, _ = pa.paged_attention(
        _Layer(), q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        None, paged=meta,
    )  # fmt: skip
    return out[0]


@pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: no CPU decode kernel")
def test_decode_only_step_returns_the_kernel_output_whole() -> None:
    meta, qkv = _step([1, 1, 1], [5, 40, 17])
    assert meta.decode_batch is not None and meta.decode_batch.all_tokens
    general = dataclasses.replace(meta, decode_batch=dataclasses.replace(meta.decode_batch))
    general.decode_batch.all_tokens = False  # type: ignore[union-attr]
    assert torch.equal(_attend(meta, qkv), _attend(general, qkv))


@pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: no CPU decode kernel")
def test_mixed_step_keeps_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # The middle request is a prefill chunk (its context past the kernel's prefill limit).
    monkeypatch.setattr(pa, "MAX_CONTEXT_AS_KERNEL_DECODES", 39)
    meta, _ = _step([1, 20, 1], [5, 40, 17])
    assert meta.decode_batch is not None and not meta.decode_batch.all_tokens
    assert len(meta.prefills) == 1
