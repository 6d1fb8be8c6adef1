"""Scheduler-side bookkeeping of which KV blocks each request holds.

The manager never touches KV tensors: it maps request ids to block ids (the
worker owns the paged tensors and receives the ids), shares full blocks between
requests through the prefix cache, and fences frees under async scheduling.

Per-request state, keyed by request id:

* ``req_to_blocks[rid]``: the request's blocks in token order; block ``i``
  holds token slots ``[i * block_size, (i + 1) * block_size)``;
* ``req_to_block_hashes[rid]``: chained hashes of the request's full blocks of
  known tokens (``all_token_ids``), extended lazily as the request grows;
* ``num_cached_blocks[rid]``: how many leading blocks have been offered to the
  prefix cache (each either registered or a duplicate of a cached block).

A request's blocks stay held until :meth:`KVCacheManager.free`, which releases
them tail first through the step fence (:mod:`tandem.kv.deferred_free`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tandem.kv.block import KVBlock
from tandem.kv.block_hash import hash_block_tokens
from tandem.kv.block_pool import BlockPool
from tandem.kv.deferred_free import DeferredFree
from tandem.kv.invariants import check_kv_invariants


class KVRequest(Protocol):
    """What the manager reads from a request (read-only, duck-typed).

    ``num_tokens == len(all_token_ids)``: the prompt plus the output tokens known
    so far (draft tokens are not part of it). ``num_computed_tokens`` counts the
    leading tokens whose KV is (or, for the step being scheduled, will be)
    written.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...


class KVCacheManager:
    """Block allocation, prefix caching and fenced frees for the scheduler.

    Contracts in brief: :meth:`get_computed_blocks` then :meth:`allocate_slots`
    admit a request (hits are only valid until the next pool mutation);
    :meth:`allocate_slots` either succeeds or changes nothing;
    :meth:`free` is idempotent. :meth:`check_invariants` states the global
    invariants.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        defer_frees: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks: int = num_blocks
        self.block_size: int = block_size
        self.enable_prefix_caching: bool = enable_prefix_caching
        self.block_pool: BlockPool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_block_hashes: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        #: vLLM's prefix-cache stats, in tokens: looked up (prompt tokens of each
        #: `get_computed_blocks` call) and found cached. Stay 0 with prefix caching off.
        self.prefix_cache_queries: int = 0
        self.prefix_cache_hits: int = 0
        self._fence: DeferredFree = DeferredFree(self.block_pool, defer_frees)

    # ------------------------------------------------------------------ views

    @property
    def num_free_blocks(self) -> int:
        """Blocks the pool can hand out now (fenced blocks are not free yet)."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held, fenced ones included."""
        return self.block_pool.usage

    @property
    def defer_frees(self) -> bool:
        """Whether :meth:`free` waits for the step fence."""
        return self._fence.defer_frees

    @property
    def scheduled_step_seq(self) -> int:
        """Number of :meth:`mark_step_scheduled` calls so far."""
        return self._fence.scheduled_step_seq

    @property
    def processed_step_seq(self) -> int:
        """Number of :meth:`mark_step_processed` calls so far."""
        return self._fence.processed_step_seq

    @property
    def num_fenced_blocks(self) -> int:
        """Blocks freed but waiting for a fence, counted with multiplicity."""
        return self._fence.num_fenced_blocks

    @property
    def pending_fences(self) -> tuple[tuple[int, tuple[KVBlock, ...]], ...]:
        """Snapshot of pending ``(fence, blocks_in_eviction_order)`` entries."""
        return self._fence.pending

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in token order (empty if it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # ---------------------------------------------------------- prefix cache

    def _block_hashes(self, request: KVRequest) -> list[int]:
        """The request's hash list, extended to all its full blocks of known tokens."""
        rid = request.request_id
        hashes = self.req_to_block_hashes.get(rid)
        if hashes is None:
            hashes = self.req_to_block_hashes[rid] = []
        bs = self.block_size
        num_full = request.num_tokens // bs
        if len(hashes) < num_full:
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), num_full):
                parent = hash_block_tokens(parent, tuple(tokens[i * bs : (i + 1) * bs]))
                hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[KVBlock], int]:
        """Longest chain of cached blocks matching the request's prefix.

        For a request about to be admitted: ``num_computed_tokens == 0`` and no
        blocks held (ValueError otherwise). Returns the hit blocks in order,
        stopping at the first miss, and the tokens they cover
        (``len(blocks) * block_size``). At most ``(num_tokens - 1) //
        block_size`` blocks are looked at, so a hit never covers the last known
        token (its logits must be computed). Ref counts are untouched: pass
        the result to :meth:`allocate_slots` before mutating the pool again.
        Returns ``([], 0)`` with prefix caching off. Adds ``num_tokens`` to
        ``prefix_cache_queries`` and the hit tokens to ``prefix_cache_hits``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        rid = request.request_id
        if request.num_computed_tokens != 0 or self.req_to_blocks.get(rid):
            raise ValueError(f"request {rid} is already admitted")
        hashes = self._block_hashes(request)
        max_blocks = min(max(request.num_tokens - 1, 0) // self.block_size, len(hashes))
        lookup = self.block_pool.cached_block_hash_to_block.get
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = lookup(hashes[i])
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when every block is free and nothing is
        fenced; returns False (changing nothing) otherwise."""
        if self._fence.num_fenced_blocks:
            return False
        return self.block_pool.reset_prefix_cache()

    # ------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVBlock] | None:
        """Grow the request's blocks to cover the slots of this step.

        Target: ``ceil((num_computed_tokens + num_new_computed_tokens +
        num_new_tokens + num_lookahead_tokens) / block_size)`` blocks; never
        shrinks. ``new_computed_blocks`` (hits from :meth:`get_computed_blocks`,
        only for a request holding no blocks, with ``num_new_computed_tokens ==
        len(new_computed_blocks) * block_size``) are prepended to the request.

        Returns None and changes nothing when the pool cannot supply the
        blocks; free cached hits (ref_cnt 0) count as unavailable, since
        touching them takes them off the free queue. On success returns the
        newly allocated blocks only (maybe ``[]``) and registers in the prefix
        cache the request's blocks that are full of known tokens after this
        step: the first ``min(num_computed_tokens + num_new_computed_tokens +
        num_new_tokens, num_tokens) // block_size``. Lookahead (draft) slots are
        never cached. Raises ValueError on negative counts or invalid hits.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                "token counts must be >= 0, got "
                f"num_new_tokens={num_new_tokens}, "
                f"num_new_computed_tokens={num_new_computed_tokens}, "
                f"num_lookahead_tokens={num_lookahead_tokens}"
            )
        rid = request.request_id
        bs = self.block_size
        req_blocks = self.req_to_blocks.get(rid)
        hits = new_computed_blocks or ()
        if hits:
            self._validate_hits(request, req_blocks, hits, num_new_computed_tokens)
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-(num_tokens_after + num_lookahead_tokens) // bs)
        num_new_blocks = max(num_required - num_held - len(hits), 0)
        pool = self.block_pool
        if num_new_blocks:
            num_free_hits = sum(1 for b in hits if b.ref_cnt == 0) if hits else 0
            if num_new_blocks > pool.num_free_blocks - num_free_hits:
                return None
        # ---- commit point: nothing above mutated state.
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        if hits:
            pool.touch(hits)
            req_blocks.extend(hits)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            num_full = min(num_tokens_after, request.num_tokens) // bs
            self._cache_full_blocks(request, req_blocks, num_full)
        return new_blocks

    def fits_after_fences(self, request: KVRequest, num_new_tokens: int) -> bool:
        """Whether growing the request by ``num_new_tokens`` would fit once every pending
        fence is passed (async scheduling: blocks freed while a step is in flight return
        only at its fence). Always False when nothing is fenced."""
        if self.num_fenced_blocks == 0:
            return False
        needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        needed -= len(self.req_to_blocks.get(request.request_id, ()))
        return needed <= self.num_free_blocks + self.num_fenced_blocks

    def _validate_hits(
        self,
        request: KVRequest,
        req_blocks: list[KVBlock] | None,
        hits: Sequence[KVBlock],
        num_new_computed_tokens: int,
    ) -> None:
        """Reject hits that are not a current cached prefix of a fresh request."""
        rid = request.request_id
        if not self.enable_prefix_caching:
            raise ValueError("new_computed_blocks given with prefix caching off")
        if req_blocks or request.num_computed_tokens:
            raise ValueError(f"prefix hits for request {rid}, which is already admitted")
        if num_new_computed_tokens != len(hits) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{len(hits)} hit blocks of {self.block_size} tokens"
            )
        hashes = self._block_hashes(request)
        if len(hits) * self.block_size >= max(request.num_tokens, 1):
            raise ValueError(f"prefix hits for request {rid} cover its last token")
        cache = self.block_pool.cached_block_hash_to_block
        for i, block in enumerate(hits):
            if block.block_hash != hashes[i] or cache.get(hashes[i]) is not block:
                raise ValueError(
                    f"stale prefix hit for request {rid}: block {block.block_id} "
                    f"is no longer cached as its block {i}"
                )

    def _cache_full_blocks(
        self, request: KVRequest, req_blocks: list[KVBlock], num_full: int
    ) -> None:
        """Offer blocks ``num_cached_blocks[rid] .. num_full - 1`` to the cache."""
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        cache_block = self.block_pool.cache_block
        for i in range(start, num_full):
            cache_block(req_blocks[i], hashes[i])
        self.num_cached_blocks[rid] = num_full

    def invalidate_blocks(self, block_ids: set[int]) -> None:
        """Forget the prefix-cache entries of blocks whose contents are garbage (a failed
        KV load): no later request may hit them. The blocks stay with their holders, who
        recompute them (:meth:`rewind` lets their recomputed blocks be cached again)."""
        pool = self.block_pool
        cache = pool.cached_block_hash_to_block
        for block_id in block_ids:
            block = pool.blocks[block_id]
            if block.block_hash is not None and cache.get(block.block_hash) is block:
                del cache[block.block_hash]
            block.block_hash = None

    def rewind(self, request_id: str, num_computed_tokens: int) -> None:
        """The request's KV is valid only below `num_computed_tokens` again (it keeps its
        blocks): its blocks from there on are offered to the prefix cache anew once
        recomputed."""
        num_valid_blocks = num_computed_tokens // self.block_size
        if self.num_cached_blocks.get(request_id, 0) > num_valid_blocks:
            self.num_cached_blocks[request_id] = num_valid_blocks

    # ------------------------------------------------------------ free/fence

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, tail first, through the fence,
        and forget its per-request state. Unknown ids are ignored.

        Tail first: the request's last blocks (least likely to be shared) are
        the first to be evicted once free.
        """
        blocks = self.req_to_blocks.pop(request_id, None)
        self.req_to_block_hashes.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        if blocks:
            blocks.reverse()  # the list is ours now: no copy
            self._fence.release(blocks)

    def mark_step_scheduled(self) -> None:
        """Call once per scheduled step that has tokens."""
        self._fence.mark_step_scheduled()

    def mark_step_processed(self) -> None:
        """Call once per processed step that had tokens (end of
        update_from_output); releases frees whose fence has passed. Raises
        RuntimeError if no step is in flight."""
        self._fence.mark_step_processed()

    # ------------------------------------------------------------ invariants

    def check_invariants(self, holders: dict[str, list[int]] | None = None) -> list[str]:
        """Human-readable invariant violations (empty when consistent).

        See :func:`tandem.kv.invariants.check_kv_invariants`. ``holders``, if
        given, is the scheduler's view (request id -> block ids) and must equal
        the manager's.
        """
        return check_kv_invariants(
            self.block_pool,
            self.req_to_blocks,
            self._fence.pending,
            holders,
            num_cached_blocks=self.num_cached_blocks,
            scheduled_step_seq=self.scheduled_step_seq,
            processed_step_seq=self.processed_step_seq,
        )

    def all_blocks_free(self) -> bool:
        """True when every block has ref_cnt 0 and no free waits for a fence."""
        return not self._fence.num_fenced_blocks and all(
            b.ref_cnt == 0 for b in self.block_pool.blocks
        )
