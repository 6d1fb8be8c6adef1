"""FreeBlockQueue: FIFO order, O(1) unlinking from anywhere, length."""

from __future__ import annotations

import pytest

from tandem.kv import FreeBlockQueue, KVBlock


def make(n: int) -> tuple[list[KVBlock], FreeBlockQueue]:
    blocks = [KVBlock(block_id=i) for i in range(n)]
    return blocks, FreeBlockQueue(blocks)


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_initial_queue_is_in_given_order_with_full_length() -> None:
    _, q = make(4)
    assert ids(q) == [0, 1, 2, 3]
    assert len(q) == 4
    assert q.num_free_blocks == 4


def test_popleft_returns_head_and_unlinks_it() -> None:
    blocks, q = make(3)
    b = q.popleft()
    assert b is blocks[0]
    assert b.prev_free is None and b.next_free is None
    assert ids(q) == [1, 2]
    assert len(q) == 2


def test_append_goes_to_tail_so_it_is_popped_last() -> None:
    _, q = make(3)
    b0 = q.popleft()
    q.append(b0)
    assert ids(q) == [1, 2, 0]
    assert [q.popleft().block_id for _ in range(3)] == [1, 2, 0]
    assert len(q) == 0


@pytest.mark.parametrize("victim, rest", [(0, [1, 2, 3]), (2, [0, 1, 3]), (3, [0, 1, 2])])
def test_remove_from_head_middle_or_tail_keeps_the_others_in_order(
    victim: int, rest: list[int]
) -> None:
    blocks, q = make(4)
    q.remove(blocks[victim])
    assert ids(q) == rest
    assert len(q) == 3
    assert not q.is_linked(blocks[victim])
    # Neighbours are relinked both ways: walking from the tail also works.
    q.append(blocks[victim])
    assert ids(q) == rest + [victim]


def test_remove_the_only_block_leaves_an_empty_queue() -> None:
    blocks, q = make(1)
    q.remove(blocks[0])
    assert len(q) == 0
    assert ids(q) == []
    with pytest.raises(IndexError):
        q.popleft()


def test_remove_of_an_unlinked_block_raises() -> None:
    blocks, q = make(2)
    b = q.popleft()
    with pytest.raises(ValueError):
        q.remove(b)
    assert len(q) == 1


def test_append_of_a_linked_block_raises() -> None:
    blocks, q = make(2)
    with pytest.raises(ValueError):
        q.append(blocks[1])
    assert ids(q) == [0, 1]


def test_popleft_n_pops_in_order_and_refuses_too_many() -> None:
    blocks, q = make(5)
    with pytest.raises(ValueError):
        q.popleft_n(6)
    assert len(q) == 5
    got = q.popleft_n(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert all(b.prev_free is None and b.next_free is None for b in got)
    assert ids(q) == [3, 4]
    assert q.popleft_n(0) == []
    assert [b.block_id for b in q.popleft_n(2)] == [3, 4]
    assert len(q) == 0
    q.append(blocks[1])
    assert ids(q) == [1]


def test_empty_queue_popleft_raises_index_error() -> None:
    _, q = make(0)
    assert len(q) == 0
    with pytest.raises(IndexError):
        q.popleft()


def test_block_repr_does_not_walk_the_queue() -> None:
    blocks, _ = make(3)
    assert "prev_free" not in repr(blocks[1])
    assert "next_free" not in repr(blocks[1])
