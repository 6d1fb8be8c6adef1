"""Step fences that defer returning freed blocks to the pool.

Under async scheduling the scheduler builds step N+1 while step N still runs on
the device. A request freed in between may own blocks that an in-flight step
still writes; handing those blocks to another request before that step is done
would let two steps write the same physical block. The fence makes a freed
block wait until every step scheduled before its free has been processed.

Protocol (driven by the scheduler through the KV cache manager):

* ``mark_step_scheduled()`` once per step that schedules tokens
  (``scheduled_step_seq += 1``);
* ``mark_step_processed()`` once per processed step that had tokens
  (``processed_step_seq += 1``, then drain);
* ``release(blocks)`` records ``(scheduled_step_seq, blocks)`` and drains.

Draining hands every pending entry whose fence is ``<= processed_step_seq`` to
:meth:`BlockPool.free_blocks`, oldest first. Invariants between calls:
``processed_step_seq <= scheduled_step_seq``; pending fences are
non-decreasing and all ``> processed_step_seq`` (so nothing is pending when no
step is in flight); ``num_fenced_blocks`` is the total length of the pending
block lists.
"""

from __future__ import annotations

from collections import deque

from tandem.kv.block import KVBlock
from tandem.kv.block_pool import BlockPool


class DeferredFree:
    """Queue of block releases waiting for a step fence (see module docstring)."""

    __slots__ = (
        "_pool",
        "defer_frees",
        "scheduled_step_seq",
        "processed_step_seq",
        "_pending",
        "_num_fenced_blocks",
    )

    def __init__(self, pool: BlockPool, defer_frees: bool = True) -> None:
        """Fence releases into ``pool``; with ``defer_frees=False`` every release
        is immediate (the unsafe behaviour, kept so tests can show the fence
        matters)."""
        self._pool = pool
        self.defer_frees: bool = defer_frees
        self.scheduled_step_seq: int = 0
        self.processed_step_seq: int = 0
        self._pending: deque[tuple[int, list[KVBlock]]] = deque()
        self._num_fenced_blocks: int = 0

    @property
    def num_fenced_blocks(self) -> int:
        """Blocks waiting for a fence, counted with multiplicity."""
        return self._num_fenced_blocks

    @property
    def pending(self) -> tuple[tuple[int, tuple[KVBlock, ...]], ...]:
        """Snapshot of the pending ``(fence, blocks_in_eviction_order)`` entries."""
        return tuple((fence, tuple(blocks)) for fence, blocks in self._pending)

    def mark_step_scheduled(self) -> None:
        """Record that one more step with tokens was scheduled."""
        self.scheduled_step_seq += 1

    def mark_step_processed(self) -> None:
        """Record that the oldest in-flight step was processed, then drain.

        Raises RuntimeError if no step is in flight.
        """
        if self.processed_step_seq >= self.scheduled_step_seq:
            raise RuntimeError(
                "mark_step_processed() without a scheduled, unprocessed step "
                f"(scheduled={self.scheduled_step_seq}, processed={self.processed_step_seq})"
            )
        self.processed_step_seq += 1
        self._drain()

    def release(self, blocks_in_eviction_order: list[KVBlock]) -> None:
        """Drop one reference from each block once the current fence has passed.

        Immediate when deferral is off or no step is in flight; otherwise the
        list is kept (not copied: the caller hands over ownership) until
        ``processed_step_seq`` reaches the current ``scheduled_step_seq``.
        """
        if not self.defer_frees or self.scheduled_step_seq == self.processed_step_seq:
            # No step in flight implies nothing is pending, so order is kept.
            self._pool.free_blocks(blocks_in_eviction_order)
            return
        self._pending.append((self.scheduled_step_seq, blocks_in_eviction_order))
        self._num_fenced_blocks += len(blocks_in_eviction_order)
        self._drain()

    def _drain(self) -> None:
        pending = self._pending
        processed = self.processed_step_seq
        while pending and pending[0][0] <= processed:
            _, blocks = pending.popleft()
            self._num_fenced_blocks -= len(blocks)
            self._pool.free_blocks(blocks)
