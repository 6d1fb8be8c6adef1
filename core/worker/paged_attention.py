"""Paged attention over a flattened batch, plugged into transformers' attention registry.

Per layer the KV cache is two pools `[num_blocks, block_size, kv_heads, head_dim]`. Each
step writes the new keys and values at `slot_mapping`, then attends:

- decodes (one query token per request) sorted by context length and attended in groups
  of similar length, one batched SDPA per group over the gathered contexts, masked to each
  request's length;
- prefill chunks one request at a time (a handful per step), causal with the chunk's offset
  into its context.

GQA is handled by SDPA (`enable_gqa`). The metadata is built once per step and reaches the
attention function through the model's keyword pass-through (`paged=`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "tandem_paged"


@dataclass(slots=True)
class PrefillSpan:
    """One request with more than one query token this step."""

    token_start: int
    token_end: int
    context_start: int  # position of the first query token
    block_ids: torch.Tensor  # [nb]


@dataclass(slots=True)
class DecodeGroup:
    """Decoding requests of similar context length, attended together."""

    token_idx: torch.Tensor  # [Rg] flat index of each decode's query token
    block_ids: torch.Tensor  # [Rg * nb] flattened block tables, padded to the group's longest
    mask: torch.Tensor  # [Rg, 1, 1, nb * block_size] keys inside each context


@dataclass(slots=True)
class PagedAttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor  # [T]
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    block_size: int


#: Decodes are sorted by context length and attended in groups of about this many, so a
#: short context is not padded to the longest one in the whole batch.
DECODE_GROUP_SIZE = 16


def _decode_group(
    decodes: list[int],
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
) -> DecodeGroup:
    device = block_tables.device
    index = torch.tensor(decodes, dtype=torch.int64, device=device)
    lens = torch.tensor([seq_lens[r] for r in decodes], dtype=torch.int64, device=device)
    num_blocks = -(-int(lens.max()) // block_size)
    keys = torch.arange(num_blocks * block_size, device=device)
    return DecodeGroup(
        token_idx=torch.tensor(
            [query_start_loc[r] for r in decodes], dtype=torch.int64, device=device
        ),
        block_ids=block_tables[index, :num_blocks].reshape(-1),
        mask=(keys[None, :] < lens[:, None])[:, None, None, :],
    )


def build_metadata(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    slot_mapping: torch.Tensor,
    query_start_loc: list[int],
    positions_start: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
) -> PagedAttentionMetadata:
    decodes = [r for r in range(len(seq_lens)) if query_start_loc[r + 1] - query_start_loc[r] == 1]
    decode_set = set(decodes)
    prefills = [
        PrefillSpan(
            token_start=query_start_loc[r],
            token_end=query_start_loc[r + 1],
            context_start=positions_start[r],
            block_ids=block_tables[r, : -(-seq_lens[r] // block_size)],
        )
        for r in range(len(seq_lens))
        if r not in decode_set and query_start_loc[r + 1] > query_start_loc[r]
    ]
    decodes.sort(key=seq_lens.__getitem__)
    groups = [
        _decode_group(
            decodes[i : i + DECODE_GROUP_SIZE], query_start_loc, seq_lens, block_tables, block_size
        )
        for i in range(0, len(decodes), DECODE_GROUP_SIZE)
    ]
    return PagedAttentionMetadata(
        kv_caches=kv_caches,
        slot_mapping=slot_mapping,
        decode_groups=groups,
        prefills=prefills,
        block_size=block_size,
    )


def _gather(pool: torch.Tensor, block_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """`[rows, kv_heads, rows_len, head_dim]` context view of the given blocks."""
    _, block_size, heads, dim = pool.shape
    return pool.index_select(0, block_ids).view(rows, -1, heads, dim).transpose(1, 2)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged: PagedAttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query `[1, Hq, T, D]`, key/value `[1, Hkv, T, D]`
    (RoPE applied). Returns `([1, T, Hq, D], None)`."""
    if paged is None:
        raise RuntimeError("tandem_paged attention needs the `paged=` metadata keyword")
    k_pool, v_pool = paged.kv_caches[module.layer_idx]
    _, heads_kv, _, dim = key.shape
    k_pool.view(-1, heads_kv, dim).index_copy_(
        0, paged.slot_mapping, key[0].transpose(0, 1).to(k_pool.dtype)
    )
    v_pool.view(-1, heads_kv, dim).index_copy_(
        0, paged.slot_mapping, value[0].transpose(0, 1).to(v_pool.dtype)
    )

    q = query[0].transpose(0, 1)  # [T, Hq, D]
    out = torch.empty_like(q)
    for group in paged.decode_groups:
        rows = group.token_idx.numel()
        qd = q.index_select(0, group.token_idx)[:, :, None, :]  # [Rg, Hq, 1, D]
        kd = _gather(k_pool, group.block_ids, rows)
        vd = _gather(v_pool, group.block_ids, rows)
        od = F.scaled_dot_product_attention(
            qd,
            kd.to(qd.dtype),
            vd.to(qd.dtype),
            attn_mask=group.mask,
            scale=scaling,
            enable_gqa=True,
        )
        out.index_copy_(0, group.token_idx, od[:, :, 0, :])
    for span in paged.prefills:
        qp = q[span.token_start : span.token_end].transpose(0, 1)[None]  # [1, Hq, n, D]
        kp = _gather(k_pool, span.block_ids, 1)
        vp = _gather(v_pool, span.block_ids, 1)
        n = span.token_end - span.token_start
        context = span.context_start + n
        kp, vp = kp[:, :, :context].to(qp.dtype), vp[:, :, :context].to(qp.dtype)
        if span.context_start == 0:
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            qpos = torch.arange(span.context_start, context, device=q.device)
            mask = torch.arange(context, device=q.device)[None, :] <= qpos[:, None]
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, scale=scaling, enable_gqa=True
            )
        out[span.token_start : span.token_end] = op[0].transpose(0, 1)
    return out[None], None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
