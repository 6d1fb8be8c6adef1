"""KVCacheManager: allocation, growth, lookahead, prefix caching, counters."""

from __future__ import annotations

import pytest

from tandem.kv import KVCacheManager
from tandem.testing.stubs import KVRequestStub as Req

BS = 4


def prefill(mgr: KVCacheManager, req: Req) -> list[int]:
    """Admit ``req`` with a prefix lookup and schedule its whole prompt."""
    hits, n_hit = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return [b.block_id for b in hits]


def snapshot(mgr: KVCacheManager) -> tuple[object, ...]:
    return (
        mgr.num_free_blocks,
        {k: list(v) for k, v in mgr.req_to_blocks.items()},
        {k: list(v) for k, v in mgr.req_to_block_hashes.items()},
        dict(mgr.num_cached_blocks),
        dict(mgr.block_pool.cached_block_hash_to_block),
        [b.ref_cnt for b in mgr.block_pool.blocks],
        [b.block_id for b in mgr.block_pool.free_block_queue],
    )


def test_allocation_covers_the_ceil_of_tokens_over_block_size() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    r = Req("a", list(range(9)))
    new = mgr.allocate_slots(r, 9)
    assert new is not None and len(new) == 3
    assert mgr.get_block_ids("a") == [b.block_id for b in new]
    assert mgr.num_free_blocks == 5
    assert mgr.check_invariants({"a": [0, 1, 2]}) == []


def test_allocate_until_exhaustion_returns_none_and_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    a = Req("a", list(range(12)))
    assert mgr.allocate_slots(a, 12) is not None
    a.num_computed_tokens = 12
    b = Req("b", [50 + i for i in range(8)])
    before = snapshot(mgr)
    assert mgr.allocate_slots(b, 8) is None
    assert snapshot(mgr) == before
    assert "b" not in mgr.req_to_blocks
    # Growing "a" past its last block also fails cleanly once the pool is dry.
    assert mgr.allocate_slots(Req("c", [1]), 1) is not None
    a.all_token_ids.append(99)
    before = snapshot(mgr)
    assert mgr.allocate_slots(a, 1) is None
    assert snapshot(mgr) == before
    assert mgr.check_invariants() == []


def test_growth_by_one_token_allocates_only_at_block_boundaries() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    r = Req("r", list(range(BS)))
    assert len(mgr.allocate_slots(r, BS) or []) == 1
    r.num_computed_tokens = BS
    for step in range(2 * BS):
        r.all_token_ids.append(1000 + step)
        new = mgr.allocate_slots(r, 1)
        assert new is not None
        expected = 1 if r.num_computed_tokens % BS == 0 else 0
        assert len(new) == expected, step
        r.num_computed_tokens += 1
    assert len(mgr.get_block_ids("r")) == 3


def test_lookahead_slots_count_toward_blocks() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    r = Req("r", list(range(BS)))
    new = mgr.allocate_slots(r, BS, num_lookahead_tokens=1)
    assert new is not None and len(new) == 2
    r.num_computed_tokens = BS
    r.all_token_ids.append(7)
    # One new token plus 3 lookahead slots fit in the already held 2nd block.
    assert mgr.allocate_slots(r, 1, num_lookahead_tokens=3) == []
    assert mgr.allocate_slots(r, 1, num_lookahead_tokens=4) is not None
    assert len(mgr.get_block_ids("r")) == 3


def test_lookahead_slots_are_never_cached() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    r = Req("r", list(range(BS - 1)))
    mgr.allocate_slots(r, BS - 1, num_lookahead_tokens=2 * BS)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert mgr.num_cached_blocks.get("r", 0) == 0


def test_negative_token_counts_raise() -> None:
    mgr = KVCacheManager(num_blocks=2, block_size=BS)
    with pytest.raises(ValueError):
        mgr.allocate_slots(Req("r", [1]), -1)
    with pytest.raises(ValueError):
        mgr.allocate_slots(Req("r", [1]), 1, num_lookahead_tokens=-1)
    assert mgr.req_to_blocks == {}


def test_prefix_hit_for_same_three_block_prompt_with_different_tail() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(3 * BS))
    a = Req("a", prompt + [100, 101])
    prefill(mgr, a)
    b = Req("b", prompt + [200])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 3 * BS
    assert [h.block_id for h in hits] == mgr.get_block_ids("a")[:3]


def test_prefix_hit_never_covers_the_last_token() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(2 * BS))
    prefill(mgr, Req("a", prompt + [1, 2, 3]))
    # Exactly two full blocks: only the first can be a hit.
    hits, n = mgr.get_computed_blocks(Req("b", list(prompt)))
    assert n == BS
    assert [h.block_id for h in hits] == mgr.get_block_ids("a")[:1]
    # The same three blocks but one more token: both hit.
    hits, n = mgr.get_computed_blocks(Req("c", prompt + [9]))
    assert n == 2 * BS


def test_prefix_hit_stops_at_the_first_miss() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(3 * BS))
    prefill(mgr, Req("a", prompt + [0]))
    changed = list(prompt)
    changed[BS] = 999  # block 1 differs, block 2 is identical token-wise
    hits, n = mgr.get_computed_blocks(Req("b", changed + [0]))
    assert n == BS and len(hits) == 1


def test_hit_counters_count_queried_and_hit_tokens() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(2 * BS))
    prefill(mgr, Req("a", prompt + [5]))
    assert mgr.prefix_cache_queries == 2 * BS + 1
    assert mgr.prefix_cache_hits == 0
    mgr.get_computed_blocks(Req("b", prompt + [6, 7]))
    assert mgr.prefix_cache_queries == (2 * BS + 1) + (2 * BS + 2)
    assert mgr.prefix_cache_hits == 2 * BS


def test_hit_blocks_are_shared_and_survive_the_first_free_as_cached_free() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(2 * BS))
    a = Req("a", prompt + [1])
    prefill(mgr, a)
    b = Req("b", prompt + [2])
    hit_ids = prefill(mgr, b)
    assert hit_ids == mgr.get_block_ids("a")[:2]
    assert mgr.get_block_ids("b")[:2] == hit_ids
    pool = mgr.block_pool
    assert [pool.blocks[i].ref_cnt for i in hit_ids] == [2, 2]
    mgr.free("a")
    assert [pool.blocks[i].ref_cnt for i in hit_ids] == [1, 1]
    mgr.free("b")
    assert all(pool.blocks[i].ref_cnt == 0 for i in hit_ids)
    # Free but still cached: a third request hits them again.
    c = Req("c", prompt + [3])
    assert prefill(mgr, c) == hit_ids
    assert mgr.check_invariants() == []


def test_allocation_counts_free_cached_hits_as_unavailable() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = list(range(2 * BS))
    prefill(mgr, Req("a", prompt + [1]))  # 3 blocks
    mgr.free("a")
    assert mgr.num_free_blocks == 4
    b = Req("b", prompt + [2] * (2 * BS + 1))  # 2 hit blocks + 3 new needed = 5 > 4
    hits, n = mgr.get_computed_blocks(b)
    assert len(hits) == 2
    before = snapshot(mgr)
    assert mgr.allocate_slots(b, b.num_tokens - n, n, hits) is None
    assert snapshot(mgr) == before
    c = Req("c", prompt + [2] * (BS + 1))  # 2 hits + 2 new = 4: fits exactly
    hits, n = mgr.get_computed_blocks(c)
    new = mgr.allocate_slots(c, c.num_tokens - n, n, hits)
    assert new is not None and len(new) == 2
    assert mgr.num_free_blocks == 0
    assert mgr.check_invariants() == []


def test_allocate_returns_only_new_blocks_not_hits() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(2 * BS))
    prefill(mgr, Req("a", prompt + [1]))
    b = Req("b", prompt + [2])
    hits, n = mgr.get_computed_blocks(b)
    new = mgr.allocate_slots(b, b.num_tokens - n, n, hits)
    assert new is not None and len(new) == 1
    assert not set(map(id, new)) & set(map(id, hits))


def test_cached_blocks_are_evicted_under_pressure() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    prompt = list(range(2 * BS))
    prefill(mgr, Req("a", prompt + [1]))
    mgr.free("a")
    assert len(mgr.block_pool.cached_block_hash_to_block) == 2
    big = Req("big", [7] * (3 * BS))
    hits, _ = mgr.get_computed_blocks(big)
    assert hits == []
    assert mgr.allocate_slots(big, big.num_tokens) is not None
    # All three blocks were recycled; the old prompt's entries are gone
    # (only big's own first two full blocks are cached now).
    old_hits, _ = mgr.get_computed_blocks(Req("again", prompt + [1]))
    assert old_hits == []
    assert all(b.block_hash is None or b.ref_cnt == 1 for b in mgr.block_pool.blocks)
    assert mgr.check_invariants() == []


def test_prefix_caching_off_returns_no_hits_and_caches_nothing() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(2 * BS))
    prefill(mgr, Req("a", prompt + [1]))
    assert mgr.get_computed_blocks(Req("b", prompt + [2])) == ([], 0)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert mgr.req_to_block_hashes == {}
    assert mgr.prefix_cache_queries == 0


def test_output_tokens_fill_blocks_that_become_cached() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    r = Req("r", [1, 2, 3])
    prefill(mgr, r)
    assert mgr.num_cached_blocks.get("r", 0) == 0
    r.all_token_ids.append(4)  # the first output token completes block 0
    mgr.allocate_slots(r, 1)
    r.num_computed_tokens += 1
    assert mgr.num_cached_blocks["r"] == 1
    hits, n = mgr.get_computed_blocks(Req("s", [1, 2, 3, 4, 5]))
    assert n == BS and hits[0].block_id == mgr.get_block_ids("r")[0]


def test_block_hashes_are_extended_lazily() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    r = Req("r", list(range(BS + 1)))
    prefill(mgr, r)
    first = list(mgr.req_to_block_hashes["r"])
    assert len(first) == 1
    r.all_token_ids.extend(range(BS))
    mgr.allocate_slots(r, BS)
    assert mgr.req_to_block_hashes["r"][:1] == first
    assert len(mgr.req_to_block_hashes["r"]) == 2


def test_stale_or_mismatched_hits_are_rejected() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = list(range(BS))
    prefill(mgr, Req("a", prompt + [1]))
    b = Req("b", prompt + [2])
    hits, n = mgr.get_computed_blocks(b)
    with pytest.raises(ValueError):
        mgr.allocate_slots(b, 1, n + 1, hits)  # token count does not match the hits
    other = Req("x", [9] * (BS + 1))
    with pytest.raises(ValueError):
        mgr.allocate_slots(other, 1, n, hits)  # hits of another prefix
    assert "b" not in mgr.req_to_blocks and "x" not in mgr.req_to_blocks


def test_free_is_idempotent_and_forgets_request_state() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    r = Req("r", list(range(BS + 1)))
    prefill(mgr, r)
    mgr.free("r")
    mgr.free("r")
    mgr.free("never-seen")
    assert mgr.num_free_blocks == 4
    assert "r" not in mgr.req_to_blocks
    assert "r" not in mgr.req_to_block_hashes
    assert "r" not in mgr.num_cached_blocks
    assert mgr.get_block_ids("r") == []
    assert mgr.all_blocks_free()


def test_reset_prefix_cache_requires_all_blocks_free() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    prefill(mgr, Req("r", list(range(BS + 1))))
    assert mgr.reset_prefix_cache() is False
    mgr.free("r")
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(Req("s", list(range(BS + 1)))) == ([], 0)


def test_usage_reflects_held_fraction() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    assert mgr.usage == 0.0
    mgr.allocate_slots(Req("r", [1]), 1)
    assert mgr.usage == pytest.approx(0.25)
