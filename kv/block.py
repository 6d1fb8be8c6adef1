"""The per-block bookkeeping record of the paged KV cache.

A ``KVBlock`` holds no tensor data: it names one physical block of the paged
KV tensors (owned by the worker) by ``block_id`` and carries the metadata the
scheduler side needs to share, cache and recycle it.

Invariants (maintained by :class:`tandem.kv.block_pool.BlockPool`):

* ``ref_cnt`` is the number of holders (requests, plus deferred frees waiting
  for a fence); it is never negative.
* ``ref_cnt == 0`` if and only if the block is linked into the pool's
  :class:`~tandem.kv.free_block_queue.FreeBlockQueue`.
* ``block_hash`` is not ``None`` only while the block is registered in the
  pool's prefix-cache map under exactly that hash.
* ``prev_free`` / ``next_free`` are owned by the free queue; nothing else may
  write them. Both are ``None`` while the block is not in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical KV-cache block (metadata only).

    Equality and hashing are by identity (``eq=False``): two blocks are the same
    block only if they are the same object, and blocks can be put in sets. The
    free-queue links are left out of ``repr`` so printing a block does not walk
    the whole queue.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    @property
    def is_cached(self) -> bool:
        """True when the block is registered in the prefix cache."""
        return self.block_hash is not None
