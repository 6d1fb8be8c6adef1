"""An intrusive doubly linked list of free KV blocks with O(1) removal.

The links live in the blocks themselves (``KVBlock.prev_free`` /
``KVBlock.next_free``), so the queue allocates nothing per operation. Two
sentinel blocks (``block_id == -1``) bracket the list, which removes every
empty/head/tail special case: a real block is in the queue exactly when both of
its links are set.

Order: the head is the next block to hand out (the least recently freed, i.e.
the first to be evicted from the prefix cache); freed blocks go to the tail.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tandem.kv.block import KVBlock


class FreeBlockQueue:
    """FIFO of free blocks: ``popleft`` from the head, ``append`` at the tail,
    ``remove`` from anywhere, all O(1).

    Invariants: ``len(self)`` equals the number of real blocks linked between
    the sentinels; every linked block has both links set, every unlinked block
    has both links ``None``.
    """

    __slots__ = ("_head", "_tail", "_len")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        """Build the queue holding ``blocks`` in the given order (head first).

        The blocks must not be linked into any queue yet.
        """
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        prev = self._head
        for block in blocks:
            if block.prev_free is not None or block.next_free is not None:
                raise ValueError(f"block {block.block_id} is already in a free queue")
            prev.next_free = block
            block.prev_free = prev
            prev = block
            self._len += 1
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def __len__(self) -> int:
        """The number of free blocks in the queue."""
        return self._len

    @property
    def num_free_blocks(self) -> int:
        """Alias of ``len(self)``."""
        return self._len

    def popleft(self) -> KVBlock:
        """Unlink and return the head block. Raises IndexError when empty."""
        block = self._head.next_free
        assert block is not None
        if block is self._tail:
            raise IndexError("popleft from an empty FreeBlockQueue")
        nxt = block.next_free
        assert nxt is not None
        self._head.next_free = nxt
        nxt.prev_free = self._head
        block.prev_free = block.next_free = None
        self._len -= 1
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Unlink and return the first ``n`` blocks, head first.

        Raises ValueError (and changes nothing) if fewer than ``n`` are free.
        """
        if n < 0 or n > self._len:
            raise ValueError(f"cannot pop {n} blocks from a queue of {self._len}")
        out: list[KVBlock] = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            nxt = block.next_free
            block.prev_free = block.next_free = None
            out.append(block)
            block = nxt
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self._len -= n
        return out

    def append(self, block: KVBlock) -> None:
        """Link ``block`` at the tail (it becomes the last to be handed out).

        Raises ValueError if the block is already linked into a queue.
        """
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in a free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from wherever it sits in the queue, in O(1).

        Raises ValueError if the block is not linked (not free).
        """
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def is_linked(self, block: KVBlock) -> bool:
        """True if ``block`` is linked into a free queue (O(1), by its links)."""
        return block.prev_free is not None and block.next_free is not None

    def __iter__(self) -> Iterator[KVBlock]:
        """Yield the free blocks head to tail (for debugging and invariant checks;
        do not mutate the queue while iterating)."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __repr__(self) -> str:
        return f"FreeBlockQueue({[b.block_id for b in self]})"
