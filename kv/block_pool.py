"""The pool of KV blocks: allocation, reference counting and the prefix-cache map.

``BlockPool`` owns every :class:`~tandem.kv.block.KVBlock` (``blocks[i].block_id
== i``), the queue of free ones and the map from block hash to cached block.

Invariants (with no operation in progress):

* a block is in ``free_block_queue`` if and only if its ``ref_cnt`` is 0;
* ``cached_block_hash_to_block[h].block_hash == h`` for every entry, and every
  block with a ``block_hash`` is the map entry for that hash;
* a cached block may be free (ref_cnt 0): its content stays reusable until it
  is popped from the queue for a new owner, at which point it is evicted.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.kv.block import KVBlock
from tandem.kv.free_block_queue import FreeBlockQueue


class BlockPool:
    """Fixed set of ``num_blocks`` blocks with LRU reuse of freed blocks."""

    __slots__ = (
        "num_blocks",
        "enable_prefix_caching",
        "blocks",
        "free_block_queue",
        "cached_block_hash_to_block",
    )

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        """Create ``num_blocks`` free, uncached blocks queued in block_id order."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks: int = num_blocks
        self.enable_prefix_caching: bool = enable_prefix_caching
        self.blocks: list[KVBlock] = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue: FreeBlockQueue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached or not): what ``get_new_blocks`` can hand out."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held (ref_cnt > 0), in [0, 1]; 0.0 for an empty pool."""
        if self.num_blocks == 0:
            return 0.0
        return 1.0 - len(self.free_block_queue) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Hand out ``n`` free blocks from the queue head, each with ref_cnt 1.

        A popped block that is still cached is evicted first (its hash is
        dropped, and removed from the map if the map entry is that block).
        Raises ValueError, changing nothing, if ``n`` exceeds the free count.
        """
        if n > len(self.free_block_queue):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self.free_block_queue)} free")
        blocks = self.free_block_queue.popleft_n(n)
        cache = self.cached_block_hash_to_block
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            h = block.block_hash
            if h is not None:
                if cache.get(h) is block:
                    del cache[h]
                block.block_hash = None
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block (prefix-cache hits).

        A block at ref_cnt 0 is a free cached block: it is taken out of the free
        queue, so it can no longer be evicted while referenced.
        """
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in order.

        Blocks reaching ref_cnt 0 are appended to the free-queue tail in the
        given order, so the caller passes them in eviction order (first passed
        = first evicted). A block keeps its hash: it stays a reusable cache
        entry until popped. Asserts that no ref_cnt goes negative.
        """
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed more often than held"
            if block.ref_cnt == 0:
                queue.append(block)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        """The block cached under ``block_hash``, or None (always None when off)."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        """Register a full, held block in the prefix cache under ``block_hash``.

        No-op when prefix caching is off, when the block already carries this
        hash, or when another block already caches this hash (the duplicate then
        stays uncached and is recycled normally). Raises ValueError if the block
        already carries a different hash (a block's content never changes while
        it is held).
        """
        if not self.enable_prefix_caching:
            return
        current = block.block_hash
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block.block_id} is cached as {current}, not {block_hash}")
            return
        cache = self.cached_block_hash_to_block
        if block_hash in cache:
            return
        block.block_hash = block_hash
        cache[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Drop every cache entry; allowed only when every block is free.

        Returns False (changing nothing) if any block is held, True otherwise.
        """
        if len(self.free_block_queue) != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
