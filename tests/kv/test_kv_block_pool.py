"""BlockPool: LRU allocation, ref counting, eviction of cached free blocks."""

from __future__ import annotations

import pytest

from tandem.kv import BlockPool


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def test_allocation_pops_the_lru_head_with_ref_cnt_one() -> None:
    pool = BlockPool(4, enable_prefix_caching=True)
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [0, 1]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(0.5)


def test_allocating_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3, enable_prefix_caching=True)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert free_ids(pool) == [1, 2]


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(3, enable_prefix_caching=False)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([b])
    pool.free_blocks([a])
    assert [x.block_id for x in pool.get_new_blocks(2)] == [b.block_id, a.block_id]


def test_freeing_tail_first_makes_the_last_block_evicted_first() -> None:
    pool = BlockPool(3, enable_prefix_caching=True)
    req = pool.get_new_blocks(3)
    for i, blk in enumerate(req):
        pool.cache_block(blk, 100 + i)
    pool.free_blocks(reversed(req))  # a request frees its blocks tail first
    assert free_ids(pool) == [2, 1, 0]
    (victim,) = pool.get_new_blocks(1)
    assert victim is req[2]
    # The first blocks of the request (the likely shared prefix) survive.
    assert pool.get_cached_block(100) is req[0]
    assert pool.get_cached_block(101) is req[1]
    assert pool.get_cached_block(102) is None


def test_popping_a_cached_free_block_evicts_its_hash() -> None:
    pool = BlockPool(1, enable_prefix_caching=True)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, 42)
    pool.free_blocks([blk])
    assert pool.get_cached_block(42) is blk  # free but still cached
    (again,) = pool.get_new_blocks(1)
    assert again is blk
    assert blk.block_hash is None
    assert pool.get_cached_block(42) is None
    assert pool.cached_block_hash_to_block == {}


def test_touch_revives_a_free_cached_block_and_takes_it_off_the_queue() -> None:
    pool = BlockPool(3, enable_prefix_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_block(blocks[1], 7)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(7)
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.num_free_blocks == 2
    assert free_ids(pool) == [0, 2]
    # It can no longer be handed out (or evicted) while held.
    assert hit not in pool.get_new_blocks(2)
    assert pool.get_cached_block(7) is hit


def test_shared_prefix_block_stays_held_until_both_holders_free_it() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    (shared,) = pool.get_new_blocks(1)
    pool.cache_block(shared, 5)
    pool.touch([shared])  # a second request hits it
    assert shared.ref_cnt == 2
    pool.free_blocks([shared])
    assert shared.ref_cnt == 1
    assert pool.num_free_blocks == 1
    pool.free_blocks([shared])
    assert shared.ref_cnt == 0
    assert pool.num_free_blocks == 2
    assert pool.get_cached_block(5) is shared


def test_double_free_is_caught() -> None:
    pool = BlockPool(1, enable_prefix_caching=False)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(AssertionError):
        pool.free_blocks([blk])


def test_cache_block_keeps_the_first_block_for_a_hash() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 9)
    pool.cache_block(b, 9)
    assert pool.get_cached_block(9) is a
    assert b.block_hash is None
    # Evicting the duplicate later must not drop the real entry.
    pool.free_blocks([b])
    pool.get_new_blocks(1)
    assert pool.get_cached_block(9) is a


def test_cache_block_with_a_different_hash_is_rejected() -> None:
    pool = BlockPool(1, enable_prefix_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 1)
    pool.cache_block(a, 1)  # same hash again: no-op
    with pytest.raises(ValueError):
        pool.cache_block(a, 2)
    assert pool.cached_block_hash_to_block == {1: a}


def test_cache_block_is_a_no_op_with_prefix_caching_off() -> None:
    pool = BlockPool(1, enable_prefix_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 1)
    assert a.block_hash is None
    assert pool.get_cached_block(1) is None


def test_reset_prefix_cache_only_when_all_blocks_are_free() -> None:
    pool = BlockPool(2, enable_prefix_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 1)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(1) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(1) is None
    assert a.block_hash is None


def test_empty_pool_reports_zero_usage() -> None:
    pool = BlockPool(0, enable_prefix_caching=True)
    assert pool.usage == 0.0
    assert pool.get_new_blocks(0) == []
