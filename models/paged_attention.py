"""Paged attention over a flattened batch, plugged into transformers' attention registry.

Per layer the KV cache is two pools: values `[num_blocks, block_size, kv_heads, head_dim]`,
keys the same or, with the compiled CPU decode kernel, transposed per block
`[num_blocks, kv_heads, head_dim, block_size]` (`keys_transposed`). Each step writes the
new keys and values at `slot_mapping`, then attends:

- decodes (one query token per request) and short spans (up to `MAX_SPAN_AS_DECODES`
  query tokens: draft verification), each query token as a decode that sees its causal
  prefix: with the CPU kernel, all at once, reading the pools in place
  (`cpu_kernels.PagedDecodeKernel`; the kernel runs the consecutive rows of one request
  as query tiles that share each key and value load); otherwise sorted by context length
  and attended in groups of similar length, one batched SDPA per group over the gathered
  contexts, masked to each query's length. With the CPU kernel, prefill chunks of requests whose context is
  at most `MAX_CONTEXT_AS_KERNEL_DECODES` tokens are attended as decodes too;
- longer prefill chunks one request at a time (a handful per step), causal with the
  chunk's offset into its context. On CPU (`_prefill_split`): two mask-free flash calls,
  causal over the chunk's own fresh keys (no gather), and, with a cached prefix, unmasked
  over the prefix gathered from the pools, merged by their logsumexps; elsewhere
  (`_prefill_gathered`): SDPA over the gathered context with a causal-with-offset mask.

The pools are allocated unfilled (`torch.empty`), so a slot nobody wrote may hold NaN.
Every path keeps such garbage away from the softmax: the CPU kernel reads and weighs only
the `seq_len` keys of each request; a prefill chunk slices its context to the positions
written; a decode group's padded keys and values (past a query's length: the tail of its
last block, and the padding blocks of shorter tables) are zeroed after the gather, because
a boolean mask alone does not help: NaN + -inf is NaN, and a zero weight times NaN is NaN.

GQA is handled by SDPA (`enable_gqa`). The metadata is built once per step and reaches the
attention function through the model's keyword pass-through (`paged=`).

Prefill cost (`python benchmarks/prefill_attention.py`, results/prefill_attention.json;
SmolLM2 shapes, 2-core AVX2 EPYC, fp32 matmul roofline 92 / 137 GFLOP/s at 1 / 2 threads;
causal-half FLOPs): the gather is 0.4-11% of a chunk's call (the high end at 128-token
chunks, about 1 ms), so the time is the attention itself. SDPA's CPU flash kernel already
runs GQA without copies; with a cached prefix, the old explicit mask made it compute every
masked block: the split path is 1.05-1.6x faster there (50-76% of the roofline at 2
threads). A fresh chunk gains nothing (0.9-1.1x: same kernel, no gather); the kernel
reaches 19% / 32% / 60% / 68% of the roofline at 128 / 512 / 1024 / 2048 tokens (small
tiles, K = head_dim = 64 dot products, the per-score softmax work), and a torch-level
block-causal alternative (bmm + softmax, GQA heads stacked; a 1-thread scratch test, not in
the benchmark) came within 8% of it either way: beating it at ~500-token chunks would take
a compiled kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.models.cpu_kernels import PagedDecodeKernel

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
    padding: torch.Tensor  # [Rg, 1, nb * block_size, 1] keys outside it (zeroed after gather)


@dataclass(slots=True)
class DecodeBatch:
    """Every decoding request of the step, for the CPU decode kernel."""

    token_idx: torch.Tensor  # [Rd]
    block_tables: torch.Tensor  # [Rd, max_blocks] int64, contiguous
    seq_lens: torch.Tensor  # [Rd] int64
    #: The step is decodes only, token i the query of decode i: the kernel's output is the
    #: step's whole attention output, no gather or scatter of rows.
    all_tokens: bool = False


@dataclass(slots=True)
class PagedAttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor  # [T]
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    block_size: int
    decode_kernel: PagedDecodeKernel | None = None
    decode_batch: DecodeBatch | None = None
    # transposed keys: each new token's (block, offset in block) in a [blocks, heads, dim, block] pool
    key_write_slots: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def keys_transposed(self) -> bool:
        return self.decode_kernel is not None


#: Decodes are sorted by context length and attended in groups of about this many, so a
#: short context is not padded to the longest one in the whole batch.
DECODE_GROUP_SIZE = 16
#: A request with at most this many query tokens (a decode, or a verify step's 1 + k
#: drafts) is attended as that many decodes: query token i of a span starting at position
#: s sees the s + i + 1 keys of its causal prefix (this step's keys are written before
#: attending). One batched decode call then replaces one SDPA per request and layer.
MAX_SPAN_AS_DECODES = 16
#: With the compiled CPU decode kernel, every request whose context (cached prefix and this
#: step's tokens) is at most this long is attended as decodes, whatever its span: the kernel
#: reads each query's causal prefix in place, which beats the flash prefill path (SDPA's CPU
#: flash kernel, small tiles at these lengths). `python benchmarks/prefill_as_decodes.py`
#: (SmolLM2, 2-core AVX-512 EPYC), time to first token, decodes / flash: Q4_1 kept 0.88-0.91
#: at 64-250 prompt tokens, 0.93-0.95 at 400-700, 1.05 at 1,024 (2 threads), 0.89-0.96 at
#: 64-250 and 1.04 at 700 (1 thread); bf16 0.91-0.96 up to 1,024; behind a 300-token cached
#: prefix 0.87-0.94. Longer contexts stream each query's keys from beyond L2: flash path.
MAX_CONTEXT_AS_KERNEL_DECODES = 512


def _decode_group(
    queries: list[tuple[int, int, int]], block_tables: torch.Tensor, block_size: int
) -> DecodeGroup:
    """`queries`: (flat token index, request row, keys visible) of each decode query."""
    device = block_tables.device
    index = torch.tensor([r for _, r, _ in queries], dtype=torch.int64, device=device)
    lens = torch.tensor([n for _, _, n in queries], dtype=torch.int64, device=device)
    num_blocks = -(-int(lens.max()) // block_size)
    keys = torch.arange(num_blocks * block_size, device=device)
    inside = keys[None, :] < lens[:, None]  # [Rg, nb * block_size]
    return DecodeGroup(
        token_idx=torch.tensor([t for t, _, _ in queries], dtype=torch.int64, device=device),
        block_ids=block_tables[index, :num_blocks].reshape(-1),
        mask=inside[:, None, None, :],
        padding=~inside[:, None, :, None],
    )


def build_metadata(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    slot_mapping: torch.Tensor,
    query_start_loc: list[int],
    positions_start: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    block_size: int,
    decode_kernel: PagedDecodeKernel | None = None,
) -> PagedAttentionMetadata:
    """Per-step attention plan. With `decode_kernel` the key pools must be transposed per
    block (see the module docstring)."""
    # (flat token index, request row, keys visible) of every query attended as a decode.
    decodes: list[tuple[int, int, int]] = []
    decode_set: set[int] = set()
    for r in range(len(seq_lens)):
        start, n = query_start_loc[r], query_start_loc[r + 1] - query_start_loc[r]
        kernel_span = decode_kernel is not None and seq_lens[r] <= MAX_CONTEXT_AS_KERNEL_DECODES
        if n > 0 and (n <= MAX_SPAN_AS_DECODES or kernel_span):
            decode_set.add(r)
            first = seq_lens[r] - n + 1
            decodes.extend((start + i, r, first + i) for i in range(n))
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
    meta = PagedAttentionMetadata(
        kv_caches=kv_caches,
        slot_mapping=slot_mapping,
        decode_groups=[],
        prefills=prefills,
        block_size=block_size,
        decode_kernel=decode_kernel,
    )
    if decode_kernel is not None:
        blocks = slot_mapping // block_size
        meta.key_write_slots = (blocks, slot_mapping - blocks * block_size)
    if not decodes:
        return meta
    if decode_kernel is not None:
        device = block_tables.device
        index = torch.tensor([r for _, r, _ in decodes], dtype=torch.int64, device=device)
        lens = [n for _, _, n in decodes]
        tokens = [t for t, _, _ in decodes]
        meta.decode_batch = DecodeBatch(
            token_idx=torch.tensor(tokens, dtype=torch.int64, device=device),
            block_tables=block_tables[index, : -(-max(lens) // block_size)]
            .to(torch.int64)
            .contiguous(),
            seq_lens=torch.tensor(lens, dtype=torch.int64, device=device),
            all_tokens=tokens == list(range(slot_mapping.shape[0])),
        )
        return meta
    decodes.sort(key=lambda query: query[2])
    meta.decode_groups = [
        _decode_group(decodes[i : i + DECODE_GROUP_SIZE], block_tables, block_size)
        for i in range(0, len(decodes), DECODE_GROUP_SIZE)
    ]
    return meta


def _gather(pool: torch.Tensor, block_ids: torch.Tensor, rows: int) -> torch.Tensor:
    """`[rows, kv_heads, rows_len, head_dim]` context view of the given blocks."""
    _, block_size, heads, dim = pool.shape
    return pool.index_select(0, block_ids).view(rows, -1, heads, dim).transpose(1, 2)


def _gather_rows(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`[1, kv_heads, len, head_dim]` context of one request's blocks (`_gather`, one row)."""
    return _gather(pool, block_ids, 1)


def _gather_transposed(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`[1, kv_heads, len, head_dim]` keys of the given blocks from a transposed key pool."""
    _, heads, dim, block_size = pool.shape
    blocks = pool.index_select(0, block_ids)  # [nb, heads, dim, block_size]
    return blocks.permute(1, 0, 3, 2).reshape(heads, -1, dim)[None]


def _write_kv(
    meta: PagedAttentionMetadata, layer_idx: int, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Store this step's `[T, kv_heads, head_dim]` keys and values at `slot_mapping`."""
    k_pool, v_pool = meta.kv_caches[layer_idx]
    write = getattr(meta.decode_kernel, "write_kv", None)  # a test double may lack it
    if write is not None and write(k_pool, v_pool, key, value, meta.slot_mapping):
        return
    v_pool.view(-1, *value.shape[1:]).index_copy_(0, meta.slot_mapping, value.to(v_pool.dtype))
    if meta.key_write_slots is not None:
        # one [heads, dim] column per token (3x faster than a flat element-wise index_copy_)
        blocks, offsets = meta.key_write_slots
        k_pool[blocks, :, :, offsets] = key.to(k_pool.dtype)
    else:
        k_pool.view(-1, *key.shape[1:]).index_copy_(0, meta.slot_mapping, key.to(k_pool.dtype))


#: The CPU flash-attention op: like SDPA, but it also returns each query's logsumexp,
#: which lets two attentions over disjoint key sets merge exactly (see `_prefill_split`).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefill_gathered(
    paged: PagedAttentionMetadata,
    layer_idx: int,
    qp: torch.Tensor,
    span: PrefillSpan,
    scaling: float | None,
) -> torch.Tensor:
    """`[1, Hq, n, D]` attention of a prefill chunk over its whole context gathered from the
    pools (this step's keys written first), masked to the chunk's offset. Any device."""
    k_pool, v_pool = paged.kv_caches[layer_idx]
    if paged.keys_transposed:
        kp = _gather_transposed(k_pool, span.block_ids)
    else:
        kp = _gather(k_pool, span.block_ids, 1)
    vp = _gather(v_pool, span.block_ids, 1)
    n = qp.shape[2]
    context = span.context_start + n  # every position below it is written: no garbage
    kp, vp = kp[:, :, :context].to(qp.dtype), vp[:, :, :context].to(qp.dtype)
    if span.context_start == 0:
        return F.scaled_dot_product_attention(
            qp, kp, vp, is_causal=True, scale=scaling, enable_gqa=True
        )
    qpos = torch.arange(span.context_start, context, device=qp.device)
    mask = torch.arange(context, device=qp.device)[None, :] <= qpos[:, None]
    return F.scaled_dot_product_attention(
        qp, kp, vp, attn_mask=mask, scale=scaling, enable_gqa=True
    )


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied if its last dimension is strided: the flash op reads rows as dense
    vectors (SDPA checks this before calling it; a direct call must). A one-block
    `_gather_transposed` is such a view."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _prefill_split(
    paged: PagedAttentionMetadata,
    layer_idx: int,
    qp: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    span: PrefillSpan,
    scaling: float | None,
    out: torch.Tensor,
) -> None:
    """CPU: the chunk's attention written into `out` `[n, Hq, D]`, as two mask-free flash
    calls: causal over its own fresh keys `kc`/`vc` `[1, Hkv, n, D]` (no gather), and,
    with a cached prefix, unmasked over the prefix's `context_start` keys gathered from
    the pools (only the blocks holding them); merged by their logsumexps. An explicit
    causal-with-offset mask instead makes the flash kernel compute every masked block."""
    prefix = span.context_start
    if prefix == 0:
        op = F.scaled_dot_product_attention(
            qp, kc, vc, is_causal=True, scale=scaling, enable_gqa=True
        )
        out.copy_(op[0].transpose(0, 1))
        return
    assert _FLASH_CPU is not None
    k_pool, v_pool = paged.kv_caches[layer_idx]
    blocks = span.block_ids[: -(-prefix // paged.block_size)]
    gather_keys = _gather_transposed if paged.keys_transposed else _gather_rows
    kp = gather_keys(k_pool, blocks)
    vp = _gather(v_pool, blocks, 1)
    kp, vp = kp[:, :, :prefix].to(qp.dtype), vp[:, :, :prefix].to(qp.dtype)
    qp, kc, vc, kp, vp = (_unit_stride(t) for t in (qp, kc, vc, kp, vp))
    o_chunk, lse_chunk = _FLASH_CPU(qp, kc, vc, 0.0, True, scale=scaling)
    o_prefix, lse_prefix = _FLASH_CPU(qp, kp, vp, 0.0, False, scale=scaling)
    # softmax over both key sets = o_chunk + w (o_prefix - o_chunk), w = the prefix's share
    weight = torch.sigmoid(lse_prefix - lse_chunk)[0].transpose(0, 1)[..., None]  # [n, Hq, 1]
    torch.lerp(
        o_chunk[0].transpose(0, 1), o_prefix[0].transpose(0, 1), weight.to(out.dtype), out=out
    )


def _attend_prefill(
    paged: PagedAttentionMetadata,
    layer_idx: int,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    span: PrefillSpan,
    scaling: float | None,
    out: torch.Tensor,
) -> None:
    """One prefill chunk: `q`/`out` `[T, Hq, D]`, `key`/`value` this step's `[1, Hkv, T, D]`
    (already written to the pools). CPU with the flash op: `_prefill_split`; otherwise
    `_prefill_gathered`."""
    s, e = span.token_start, span.token_end
    qp = q[s:e].transpose(0, 1)[None]  # [1, Hq, n, D]
    if q.device.type != "cpu" or _FLASH_CPU is None:
        out[s:e] = _prefill_gathered(paged, layer_idx, qp, span, scaling)[0].transpose(0, 1)
        return
    k_pool, v_pool = paged.kv_caches[layer_idx]
    # Through the pool dtype, as the gathered path would see them (a no-op when equal).
    kc = key[:, :, s:e].to(k_pool.dtype).to(qp.dtype)
    vc = value[:, :, s:e].to(v_pool.dtype).to(qp.dtype)
    _prefill_split(paged, layer_idx, qp, kc, vc, span, scaling, out[s:e])


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
    _write_kv(paged, module.layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1))

    q = query[0].transpose(0, 1)  # [T, Hq, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    batch = paged.decode_batch
    if batch is not None and batch.all_tokens:
        assert paged.decode_kernel is not None
        out = paged.decode_kernel(q, k_pool, v_pool, batch.block_tables, batch.seq_lens, scale)
        return out[None], None
    out = torch.empty_like(q)
    if batch is not None:
        assert paged.decode_kernel is not None
        out.index_copy_(
            0,
            batch.token_idx,
            paged.decode_kernel(
                q.index_select(0, batch.token_idx),
                k_pool,
                v_pool,
                batch.block_tables,
                batch.seq_lens,
                scale,
            ),
        )
    for group in paged.decode_groups:
        rows = group.token_idx.numel()
        qd = q.index_select(0, group.token_idx)[:, :, None, :]  # [Rg, Hq, 1, D]
        # The gathers are fresh copies: zero their padding in place (see the module docs).
        kd = _gather(k_pool, group.block_ids, rows).masked_fill_(group.padding, 0)
        vd = _gather(v_pool, group.block_ids, rows).masked_fill_(group.padding, 0)
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
        _attend_prefill(paged, module.layer_idx, q, key, value, span, scaling, out)
    return out[None], None


@functools.cache
def hf_attention_name() -> str:
    """`ATTENTION_NAME`, registered with transformers' attention functions (once): the
    `attn_implementation` of transformers models whose own layers run (`fused=False`, the
    whole-model load). Registered on demand, as importing `transformers.AttentionInterface`
    imports its model classes (`light_skeleton` says what that costs)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
