"""Property test: random admit/grow/free/schedule/process sequences over a tiny
pool keep every invariant, agree with an independent model of who holds which
block, never hand out a block that is held or fenced, and only return prefix
hits whose content matches the request's prompt."""

from __future__ import annotations

from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kv import KVCacheManager
from tandem.testing.stubs import KVRequestStub as Req

OPS = ["admit"] * 3 + ["grow"] * 4 + ["free"] * 2 + ["schedule"] * 2 + ["process"] * 2


class Model:
    """Independent expectation of the manager's state, kept by the test."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.bs = mgr.block_size
        self.running: dict[str, Req] = {}
        self.holders: dict[str, list[int]] = {}
        self.fenced: list[tuple[int, list[int]]] = []
        # block id -> the token prefix whose last block it holds (full blocks only)
        self.content: dict[int, tuple[int, ...]] = {}

    def busy_ids(self) -> set[int]:
        busy = {i for ids in self.holders.values() for i in ids}
        busy.update(i for _, ids in self.fenced for i in ids)
        return busy

    def snapshot(self) -> tuple[object, ...]:
        m = self.mgr
        return (
            m.num_free_blocks,
            {k: m.get_block_ids(k) for k in m.req_to_blocks},
            dict(m.num_cached_blocks),
            dict(m.block_pool.cached_block_hash_to_block),
            [b.ref_cnt for b in m.block_pool.blocks],
            [b.block_hash for b in m.block_pool.blocks],
            [b.block_id for b in m.block_pool.free_block_queue],
        )

    def record_success(self, r: Req, hit_ids: list[int], new_ids: list[int]) -> None:
        """Check and record a successful allocate_slots for ``r``."""
        assert not self.busy_ids() & set(new_ids), "handed out a held or fenced block"
        for bid in new_ids:
            self.content.pop(bid, None)  # recycled: old content is gone
        ids = self.holders.setdefault(r.request_id, [])
        ids.extend(hit_ids)
        ids.extend(new_ids)
        num_full = min(r.num_computed_tokens, r.num_tokens) // self.bs
        for i in range(num_full):
            prefix = tuple(r.all_token_ids[: (i + 1) * self.bs])
            old = self.content.setdefault(ids[i], prefix)
            assert old == prefix, "a held block's content changed"

    def check(self) -> None:
        m = self.mgr
        assert m.check_invariants(self.holders) == []
        assert m.num_fenced_blocks == sum(len(ids) for _, ids in self.fenced)
        assert m.num_free_blocks == m.num_blocks - len(self.busy_ids())


@settings(max_examples=examples(200), deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(4, 16),
    block_size=st.integers(2, 4),
    prefix_caching=st.booleans(),
)
def test_random_operations_preserve_invariants(
    data: st.DataObject, num_blocks: int, block_size: int, prefix_caching: bool
) -> None:
    mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    model = Model(mgr)
    tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=4 * block_size)
    next_id = 0
    for _ in range(data.draw(st.integers(1, 60), label="num_ops")):
        op = data.draw(st.sampled_from(OPS), label="op")
        if op in ("grow", "free") and not model.running:
            op = "admit"
        if op == "admit":
            rid = f"r{next_id}"
            next_id += 1
            r = Req(rid, data.draw(tokens_st, label="prompt"))
            hits, n_hit = mgr.get_computed_blocks(r)
            assert n_hit == len(hits) * block_size
            assert n_hit <= r.num_tokens - 1
            for i, h in enumerate(hits):
                assert model.content.get(h.block_id) == tuple(
                    r.all_token_ids[: (i + 1) * block_size]
                ), "prefix hit with wrong content"
            chunk = data.draw(st.integers(1, r.num_tokens - n_hit), label="chunk")
            lookahead = data.draw(st.integers(0, 2), label="lookahead")
            before = model.snapshot()
            new = mgr.allocate_slots(r, chunk, n_hit, hits, lookahead)
            if new is None:
                assert model.snapshot() == before
                mgr.free(rid)  # not admitted: drop its lookup state
            else:
                r.num_computed_tokens = n_hit + chunk
                model.running[rid] = r
                model.record_success(r, [h.block_id for h in hits], [b.block_id for b in new])
        elif op == "grow":
            rid = data.draw(st.sampled_from(sorted(model.running)), label="rid")
            r = model.running[rid]
            if r.num_computed_tokens >= r.num_tokens:
                r.all_token_ids.append(data.draw(st.integers(0, 1), label="output"))
            remaining = r.num_tokens - r.num_computed_tokens
            chunk = data.draw(st.integers(1, remaining), label="chunk")
            lookahead = data.draw(st.integers(0, 2), label="lookahead")
            before = model.snapshot()
            new = mgr.allocate_slots(r, chunk, num_lookahead_tokens=lookahead)
            if new is None:
                assert model.snapshot() == before
            else:
                r.num_computed_tokens += chunk
                model.record_success(r, [], [b.block_id for b in new])
        elif op == "free":
            rid = data.draw(st.sampled_from(sorted(model.running)), label="rid")
            mgr.free(rid)
            del model.running[rid]
            ids = model.holders.pop(rid)
            if mgr.scheduled_step_seq > mgr.processed_step_seq:
                model.fenced.append((mgr.scheduled_step_seq, ids))
        elif op == "schedule":
            mgr.mark_step_scheduled()
        elif mgr.processed_step_seq < mgr.scheduled_step_seq:
            mgr.mark_step_processed()
            model.fenced = [(f, ids) for f, ids in model.fenced if f > mgr.processed_step_seq]
        model.check()

    for rid in sorted(model.running):
        mgr.free(rid)
        model.holders.pop(rid)
    while mgr.processed_step_seq < mgr.scheduled_step_seq:
        mgr.mark_step_processed()
    assert mgr.check_invariants({}) == []
    assert mgr.all_blocks_free()
    assert mgr.num_free_blocks == num_blocks
    assert mgr.req_to_blocks == {}
    assert mgr.req_to_block_hashes == {}
    assert mgr.num_cached_blocks == {}
