"""check_invariants: silent on consistent states, loud on corruption."""

from __future__ import annotations

from tandem.kv import KVCacheManager
from tandem.testing.stubs import KVRequestStub as Req

BS = 2


def busy_manager() -> KVCacheManager:
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    a = Req("a", [1, 2, 3, 4, 5])
    mgr.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    b = Req("b", [1, 2, 3, 4, 6])
    hits, n = mgr.get_computed_blocks(b)
    mgr.allocate_slots(b, b.num_tokens - n, n, hits)
    return mgr


def test_fresh_manager_is_consistent() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    assert mgr.check_invariants() == []
    assert mgr.check_invariants({}) == []
    assert mgr.all_blocks_free()


def test_shared_and_fenced_states_are_consistent() -> None:
    mgr = busy_manager()
    holders = {rid: mgr.get_block_ids(rid) for rid in ("a", "b")}
    assert mgr.check_invariants(holders) == []
    mgr.mark_step_scheduled()
    mgr.free("a")
    assert mgr.check_invariants({"b": holders["b"]}) == []
    mgr.mark_step_processed()
    assert mgr.check_invariants({"b": holders["b"]}) == []


def test_corrupted_ref_cnt_is_reported() -> None:
    mgr = busy_manager()
    blk = mgr.req_to_blocks["a"][-1]
    blk.ref_cnt += 1
    errors = mgr.check_invariants()
    assert any(f"block {blk.block_id}" in e and "ref_cnt" in e for e in errors)


def test_held_block_with_zero_ref_cnt_is_reported() -> None:
    mgr = busy_manager()
    blk = mgr.req_to_blocks["a"][-1]
    blk.ref_cnt = 0
    errors = mgr.check_invariants()
    assert any("not in the free queue" in e for e in errors)


def test_wrong_cache_entry_is_reported() -> None:
    mgr = busy_manager()
    cache = mgr.block_pool.cached_block_hash_to_block
    h = next(iter(cache))
    cache[h] = mgr.req_to_blocks["a"][-1]
    assert mgr.check_invariants() != []


def test_scheduler_view_mismatch_is_reported() -> None:
    mgr = busy_manager()
    errors = mgr.check_invariants({"a": mgr.get_block_ids("a")})
    assert any("request b" in e for e in errors)


def test_block_leaked_outside_any_holder_is_reported() -> None:
    mgr = busy_manager()
    mgr.req_to_blocks.pop("a")  # forget a request without freeing it
    errors = mgr.check_invariants()
    assert errors
    assert not mgr.all_blocks_free()
