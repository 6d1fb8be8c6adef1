"""Deferred frees: blocks freed while a step is in flight wait for its fence."""

from __future__ import annotations

import pytest

from tandem.kv import KVCacheManager
from tandem.testing.stubs import KVRequestStub as Req

BS = 2


def admit(mgr: KVCacheManager, rid: str, tokens: list[int]) -> Req:
    r = Req(rid, tokens)
    assert mgr.allocate_slots(r, r.num_tokens) is not None
    r.num_computed_tokens = r.num_tokens
    return r


def test_free_with_no_step_in_flight_is_immediate() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    admit(mgr, "a", [1, 2, 3])
    mgr.mark_step_scheduled()
    mgr.mark_step_processed()
    mgr.free("a")
    assert mgr.num_free_blocks == 4
    assert mgr.num_fenced_blocks == 0
    assert mgr.pending_fences == ()


def test_free_during_an_in_flight_step_waits_for_its_fence() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    admit(mgr, "a", [1, 2, 3])
    mgr.mark_step_scheduled()  # step 1 writes a's blocks, still running
    mgr.free("a")
    assert mgr.num_free_blocks == 2
    assert mgr.num_fenced_blocks == 2
    assert [fence for fence, _ in mgr.pending_fences] == [1]
    assert "a" not in mgr.req_to_blocks
    assert mgr.check_invariants() == []
    # Another request cannot get a's blocks while step 1 runs.
    b = Req("b", [5, 6, 7, 8, 9])
    assert mgr.allocate_slots(b, b.num_tokens) is None
    mgr.mark_step_processed()
    assert mgr.num_free_blocks == 4
    assert mgr.num_fenced_blocks == 0
    assert mgr.allocate_slots(b, b.num_tokens) is not None
    assert mgr.check_invariants() == []


def test_fenced_blocks_are_released_tail_first() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    admit(mgr, "a", [1, 2, 3, 4, 5])
    ids = mgr.get_block_ids("a")
    mgr.mark_step_scheduled()
    mgr.free("a")
    (entry,) = mgr.pending_fences
    assert [b.block_id for b in entry[1]] == ids[::-1]
    mgr.mark_step_processed()
    assert [b.block_id for b in mgr.block_pool.free_block_queue] == ids[::-1]


def test_a_free_waits_for_every_step_scheduled_before_it() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    admit(mgr, "a", [1])
    admit(mgr, "b", [2])
    mgr.mark_step_scheduled()  # step 1
    mgr.free("a")  # fence 1
    mgr.mark_step_scheduled()  # step 2
    mgr.free("b")  # fence 2
    assert [f for f, _ in mgr.pending_fences] == [1, 2]
    mgr.mark_step_processed()  # step 1 done: a's block returns, b's waits
    assert mgr.num_free_blocks == 3
    assert mgr.num_fenced_blocks == 1
    mgr.mark_step_processed()
    assert mgr.num_free_blocks == 4
    assert mgr.all_blocks_free()


def test_without_deferral_blocks_return_at_once_even_with_a_step_in_flight() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS, defer_frees=False)
    admit(mgr, "a", [1, 2, 3])
    a_ids = set(mgr.get_block_ids("a"))
    mgr.mark_step_scheduled()
    mgr.free("a")
    assert mgr.num_free_blocks == 4
    assert mgr.num_fenced_blocks == 0
    # The hazard the fence prevents: a's blocks, possibly still being written
    # by step 1, are handed to a new request right away.
    b = Req("b", [5, 6, 7, 8, 9, 10, 11, 12])
    mgr.allocate_slots(b, b.num_tokens)
    assert a_ids <= set(mgr.get_block_ids("b"))


def test_shared_block_freed_through_the_fence_stays_held_by_the_other_request() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    a = Req("a", [1, 2, 3])
    mgr.allocate_slots(a, 3)
    a.num_computed_tokens = 3
    b = Req("b", [1, 2, 4])
    hits, n = mgr.get_computed_blocks(b)
    assert n == BS
    mgr.allocate_slots(b, 1, n, hits)
    mgr.mark_step_scheduled()
    mgr.free("a")
    shared = hits[0]
    assert shared.ref_cnt == 2  # b's reference + the fenced one
    assert mgr.check_invariants() == []
    mgr.mark_step_processed()
    assert shared.ref_cnt == 1
    assert mgr.check_invariants() == []


def test_processing_more_steps_than_scheduled_raises() -> None:
    mgr = KVCacheManager(num_blocks=1, block_size=BS)
    with pytest.raises(RuntimeError):
        mgr.mark_step_processed()
    mgr.mark_step_scheduled()
    mgr.mark_step_processed()
    assert (mgr.scheduled_step_seq, mgr.processed_step_seq) == (1, 1)


def test_reset_prefix_cache_refuses_while_blocks_are_fenced() -> None:
    mgr = KVCacheManager(num_blocks=2, block_size=BS)
    admit(mgr, "a", [1, 2, 3])
    mgr.mark_step_scheduled()
    mgr.free("a")
    assert not mgr.all_blocks_free()
    assert mgr.reset_prefix_cache() is False
    mgr.mark_step_processed()
    assert mgr.all_blocks_free()
    assert mgr.reset_prefix_cache() is True
