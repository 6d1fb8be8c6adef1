"""DiffusionGemma attention over tandem's paged KV: the causal encoder and the canvas decoder.

Both read the cache through per-request block tables (`KeyWindow`): request r reads its
cached keys at positions `[lo_r, hi_r)`, gathered block by block from its table (only the
blocks that cover the range) and padded to the batch's widest window; padded and
out-of-range keys are zeroed after the gather (pools are `torch.empty`: NaN garbage must
not reach the softmax, where a zero weight times NaN is still NaN) and masked.

The reference's visibility rules (docs/diffusion-reference.md section 2; transformers
`masking_utils.sliding_window_overlay` and `DynamicSlidingWindowLayer`), W = the layer's
`sliding_window`, c = cached context length:

- encoder, query at position q: keys `kv <= q`, and on sliding layers `kv > q - W`;
- decoder (canvas at positions `c .. c + L - 1`, bidirectional, writes nothing): full
  layers see the whole context `[0, c)`, sliding layers its last `W - 1` tokens
  `[max(0, c - W + 1), c)`, both plus all L canvas keys.

RoPE is applied to queries and keys before they are cached (cached keys are final).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import apply_rotary_pos_emb


@dataclass(slots=True)
class KeyWindow:
    """Cached keys `[lo_r, hi_r)` of each of R requests, gathered as `[R, N]` key slots.

    `block_ids`: `[R * nb]` pool blocks to gather (row r: its table's blocks
    `lo_r // bs .. ceil(hi_r / bs) - 1`, padded with block 0); `valid`: `[R, N]` whether
    gathered slot j holds a key inside the window; `positions`: `[R, N]` its position;
    `full`: every slot is valid (block-aligned windows of one width: nothing to zero).
    """

    block_ids: torch.Tensor
    num_rows: int
    valid: torch.Tensor
    positions: torch.Tensor
    full: bool = False


def key_window(
    block_tables: torch.Tensor, lo: list[int], hi: list[int], block_size: int
) -> KeyWindow:
    """Plan the gather of positions `[lo[r], hi[r])` of each request (`hi[r]` may be 0)."""
    first = [low // block_size for low in lo]
    last = [-(-high // block_size) for high in hi]
    width = max((b - a for a, b in zip(first, last, strict=True)), default=0)
    ids: list[int] = []
    starts: list[int] = []
    table = block_tables.tolist()
    for r in range(len(lo)):
        row = table[r][first[r] : last[r]]
        ids.extend(row + [0] * (width - len(row)))
        starts.append(first[r] * block_size)
    device = block_tables.device
    offsets = torch.arange(width * block_size, device=device)
    positions = torch.tensor(starts, device=device)[:, None] + offsets[None, :]
    lo_t = torch.tensor(lo, device=device)[:, None]
    hi_t = torch.tensor(hi, device=device)[:, None]
    return KeyWindow(
        block_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        num_rows=len(lo),
        valid=(positions >= lo_t) & (positions < hi_t),
        positions=positions,
        full=all(
            low == a * block_size and high == a * block_size + width * block_size
            for low, high, a in zip(lo, hi, first, strict=True)
        ),
    )


def gather_window(pool: torch.Tensor, window: KeyWindow) -> torch.Tensor:
    """`[R, kv_heads, N, head_dim]` keys (or values) of `window`, zero outside it."""
    _, _, heads, dim = pool.shape
    rows = window.num_rows
    slots = window.valid.shape[1]
    gathered = pool.index_select(0, window.block_ids).view(rows, slots, heads, dim)
    if not window.full:
        gathered = gathered.masked_fill(~window.valid[:, :, None, None], 0)
    return gathered.transpose(1, 2)


def project_qkv(
    attn: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[T, hidden]` -> query `[T, Hq, D]`, key and value `[T, Hkv, D]`, as the transformers
    attention computes them (`attn` is a DiffusionGemma attention module; full-attention
    layers have no `v_proj`: V is `v_norm` of the K projection, without RoPE)."""
    tokens = hidden.shape[0]
    dim = attn.head_dim
    query = attn.q_norm(attn.q_proj(hidden).view(tokens, -1, dim))
    query = apply_rotary_pos_emb(query, cos, sin, unsqueeze_dim=1)
    key = attn.k_proj(hidden).view(tokens, -1, dim)
    value = attn.v_proj(hidden).view(tokens, -1, dim) if attn.v_proj is not None else key
    key = apply_rotary_pos_emb(attn.k_norm(key), cos, sin, unsqueeze_dim=1)
    return query, key, attn.v_norm(value)


def encoder_windows(
    block_tables: torch.Tensor,
    query_start: list[int],
    num_queries: list[int],
    window: int | None,
    block_size: int,
) -> KeyWindow:
    """Cached keys the encoder's queries of each request may see (after this step's write):
    `[0, s + n)`, or on a sliding layer `[max(0, s - W + 1), s + n)`."""
    hi = [s + n for s, n in zip(query_start, num_queries, strict=True)]
    lo = [0 if window is None else max(0, s - window + 1) for s in query_start]
    return key_window(block_tables, lo, hi, block_size)


def encoder_attention(
    query: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    keys: KeyWindow,
    token_starts: list[int],
    query_start: list[int],
    window: int | None,
) -> torch.Tensor:
    """Causal attention of `[T, Hq, D]` queries (request r: flat tokens `token_starts[r]`
    .. `token_starts[r + 1]`, at positions from `query_start[r]`) over the pools, whose
    entries for this step's tokens are already written. One SDPA per request."""
    out = torch.empty_like(query)
    k_all = gather_window(k_pool, keys).to(query.dtype)
    v_all = gather_window(v_pool, keys).to(query.dtype)
    for r in range(keys.num_rows):
        begin, end = token_starts[r], token_starts[r + 1]
        if end == begin:
            continue
        q_pos = torch.arange(query_start[r], query_start[r] + end - begin, device=query.device)
        kv_pos = keys.positions[r]
        visible = keys.valid[r][None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if window is not None:
            visible &= kv_pos[None, :] > q_pos[:, None] - window
        attended = F.scaled_dot_product_attention(
            query[begin:end].transpose(0, 1)[None],
            k_all[r : r + 1],
            v_all[r : r + 1],
            attn_mask=visible[None, None],
            scale=1.0,
            enable_gqa=True,
        )
        out[begin:end] = attended[0].transpose(0, 1)
    return out


def decoder_window(
    block_tables: torch.Tensor, context_lens: list[int], window: int | None, block_size: int
) -> KeyWindow:
    """Cached keys a canvas sees: `[0, c)`, or on a sliding layer `[max(0, c - W + 1), c)`."""
    lo = [0 if window is None else max(0, c - window + 1) for c in context_lens]
    return key_window(block_tables, lo, list(context_lens), block_size)


def decoder_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    keys: KeyWindow,
) -> torch.Tensor:
    """Bidirectional canvas attention, batched: query `[R, L, Hq, D]`, canvas key/value
    `[R, L, Hkv, D]` (not cached); every canvas query sees its request's cached window and
    the whole canvas. Returns `[R, L, Hq, D]`."""
    rows, length = query.shape[:2]
    k_ctx = gather_window(k_pool, keys).to(query.dtype)
    v_ctx = gather_window(v_pool, keys).to(query.dtype)
    k_all = torch.cat([k_ctx, key.transpose(1, 2)], dim=2)
    v_all = torch.cat([v_ctx, value.transpose(1, 2)], dim=2)
    canvas = torch.ones(rows, length, dtype=torch.bool, device=query.device)
    visible = torch.cat([keys.valid, canvas], dim=1)[:, None, None, :]
    attended = F.scaled_dot_product_attention(
        query.transpose(1, 2), k_all, v_all, attn_mask=visible, scale=1.0, enable_gqa=True
    )
    return attended.transpose(1, 2)


def grouped_decoder_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    valid: torch.Tensor,
) -> torch.Tensor:
    """`decoder_attention` over pre-gathered buffers (`diffusion_gemma_context`): `k_buf`,
    `v_buf` `[R, Hkv, C + L, D]` hold the context in their first C slots; this writes the
    canvas key/value `[R, L, Hkv, D]` into the last L and attends with `valid [R, C + L]`.

    Every canvas query of a row sees the same keys, so the G = Hq / Hkv query heads that
    share a KV head (heads `kv * G .. kv * G + G - 1`, as `enable_gqa`) are folded into
    the query length: one `[R, Hkv, G * L, D]` SDPA without GQA (each query row's
    arithmetic is unchanged)."""
    rows, length, heads, dim = query.shape
    k_buf[:, :, -length:].copy_(key.transpose(1, 2))
    v_buf[:, :, -length:].copy_(value.transpose(1, 2))
    folded = query.transpose(1, 2).reshape(rows, k_buf.shape[1], -1, dim)
    attended = F.scaled_dot_product_attention(
        folded, k_buf, v_buf, attn_mask=valid[:, None, None, :], scale=1.0
    )
    # reshape, not view: CUDA's SDPA kernels may return their output in another layout
    return attended.reshape(rows, heads, length, dim).transpose(1, 2)
