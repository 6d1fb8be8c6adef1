"""Global consistency checks of the KV block bookkeeping (tests and debugging).

Checked invariants (each violation becomes one human-readable string):

1. ``pool.blocks[i].block_id == i``; every block a request holds or a fence
   waits on is one of the pool's blocks, and no request holds a block twice.
2. Every block is exactly one of: free (ref_cnt 0, linked in the free queue,
   possibly still cached) or held (ref_cnt > 0, not in the queue) with
   ``ref_cnt`` equal to its references across requests and pending fences.
3. The free queue's length equals both its walk length and the number of
   ref_cnt-0 blocks; it holds no block twice and no sentinel leaks.
4. Every map entry ``h -> b`` has ``b.block_hash == h``; every block carrying
   a hash is the map entry for it; with prefix caching off the map is empty.
5. ``num_cached_blocks[rid] <= len(req_to_blocks[rid])``.
6. Fences: ``processed <= scheduled``; pending fences non-decreasing and all
   ``> processed``.
7. If ``holders`` is given, it maps exactly the same requests to exactly the
   same block ids as ``req_to_blocks``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from tandem.kv.block import KVBlock
from tandem.kv.block_pool import BlockPool


def check_kv_invariants(
    pool: BlockPool,
    req_to_blocks: Mapping[str, Sequence[KVBlock]],
    pending: Sequence[tuple[int, Sequence[KVBlock]]],
    holders: Mapping[str, Sequence[int]] | None = None,
    *,
    num_cached_blocks: Mapping[str, int] | None = None,
    scheduled_step_seq: int | None = None,
    processed_step_seq: int | None = None,
) -> list[str]:
    """Return every violated invariant of the module docstring (empty if none)."""
    errors = [
        f"pool.blocks[{i}] has block_id {block.block_id}"
        for i, block in enumerate(pool.blocks)
        if block.block_id != i
    ]
    refs = _count_references(pool, req_to_blocks, pending, errors)
    _check_free_queue_and_refs(pool, refs, errors)
    _check_prefix_cache(pool, errors)
    if num_cached_blocks is not None:
        for rid, n in num_cached_blocks.items():
            held = len(req_to_blocks.get(rid, ()))
            if n > held:
                errors.append(f"request {rid} has {n} cached blocks but holds {held}")
    if scheduled_step_seq is not None and processed_step_seq is not None:
        _check_fences(pending, scheduled_step_seq, processed_step_seq, errors)
    if holders is not None:
        _check_holders(req_to_blocks, holders, errors)
    return errors


def _owned(pool: BlockPool, block: KVBlock) -> bool:
    blocks = pool.blocks
    return 0 <= block.block_id < len(blocks) and blocks[block.block_id] is block


def _count_references(
    pool: BlockPool,
    req_to_blocks: Mapping[str, Sequence[KVBlock]],
    pending: Sequence[tuple[int, Sequence[KVBlock]]],
    errors: list[str],
) -> Counter[int]:
    """References per block id across requests and pending fences (invariant 1)."""
    refs: Counter[int] = Counter()
    for rid, req_blocks in req_to_blocks.items():
        ids = [b.block_id for b in req_blocks]
        if len(set(ids)) != len(ids):
            errors.append(f"request {rid} holds a block twice: {ids}")
        for b in req_blocks:
            if not _owned(pool, b):
                errors.append(f"request {rid} holds foreign block {b.block_id}")
            refs[b.block_id] += 1
    for fence, fenced in pending:
        for b in fenced:
            if not _owned(pool, b):
                errors.append(f"fence {fence} waits on foreign block {b.block_id}")
            refs[b.block_id] += 1
    return refs


def _check_free_queue_and_refs(pool: BlockPool, refs: Counter[int], errors: list[str]) -> None:
    """Invariants 2 and 3: free or held, ref counts, the free queue's shape."""
    queued: list[KVBlock] = list(pool.free_block_queue)
    queued_ids = {id(b) for b in queued}
    if len(queued_ids) != len(queued):
        errors.append("free queue contains a block twice")
    if len(queued) != len(pool.free_block_queue):
        errors.append(f"free queue len {len(pool.free_block_queue)} != walk length {len(queued)}")
    for b in queued:
        if not _owned(pool, b):
            errors.append(f"free queue contains foreign block {b.block_id}")
    num_zero = 0
    for block in pool.blocks:
        bid, rc = block.block_id, block.ref_cnt
        in_queue = id(block) in queued_ids
        if rc < 0:
            errors.append(f"block {bid} has negative ref_cnt {rc}")
        if rc == 0:
            num_zero += 1
            if not in_queue:
                errors.append(f"block {bid} has ref_cnt 0 but is not in the free queue")
        elif in_queue:
            errors.append(f"block {bid} has ref_cnt {rc} but is in the free queue")
        if rc != refs[bid]:
            errors.append(f"block {bid} has ref_cnt {rc} but {refs[bid]} references")
    if num_zero != len(pool.free_block_queue):
        errors.append(
            f"{num_zero} blocks have ref_cnt 0 but the free queue has {len(pool.free_block_queue)}"
        )


def _check_prefix_cache(pool: BlockPool, errors: list[str]) -> None:
    """Invariant 4: the hash map and the blocks' hashes agree."""
    cache = pool.cached_block_hash_to_block
    if not pool.enable_prefix_caching and cache:
        errors.append(f"prefix caching is off but {len(cache)} blocks are cached")
    for h, b in cache.items():
        if b.block_hash != h:
            errors.append(f"cache entry {h} points to block {b.block_id} hashed {b.block_hash}")
        if not _owned(pool, b):
            errors.append(f"cache entry {h} points to foreign block {b.block_id}")
    for block in pool.blocks:
        h = block.block_hash
        if h is not None and cache.get(h) is not block:
            errors.append(f"block {block.block_id} carries hash {h} but is not its cache entry")


def _check_fences(
    pending: Sequence[tuple[int, Sequence[KVBlock]]],
    scheduled_step_seq: int,
    processed_step_seq: int,
    errors: list[str],
) -> None:
    """Invariant 6: processed <= scheduled; pending fences ordered and not yet passed."""
    if processed_step_seq > scheduled_step_seq:
        errors.append(
            f"processed_step_seq {processed_step_seq} > scheduled_step_seq {scheduled_step_seq}"
        )
    last = processed_step_seq
    for fence, _ in pending:
        if fence <= processed_step_seq:
            errors.append(f"fence {fence} has passed but its blocks are still pending")
        if fence < last:
            errors.append(f"pending fences out of order at fence {fence}")
        last = fence


def _check_holders(
    req_to_blocks: Mapping[str, Sequence[KVBlock]],
    holders: Mapping[str, Sequence[int]],
    errors: list[str],
) -> None:
    """Invariant 7: the manager's view equals the holders' view."""
    mine = {rid: [b.block_id for b in bl] for rid, bl in req_to_blocks.items()}
    theirs = {rid: list(ids) for rid, ids in holders.items()}
    for rid in sorted(mine.keys() | theirs.keys()):
        if mine.get(rid) != theirs.get(rid):
            errors.append(
                f"request {rid}: manager holds {mine.get(rid)}, holders say {theirs.get(rid)}"
            )
