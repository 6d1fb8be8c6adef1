"""The persistent input batch keeps rows put and moves as little as possible."""

from __future__ import annotations

from tandem.core.worker.input_batch import InputBatch
from tandem.sampling_params import SamplingParams


def _params(t: float) -> SamplingParams:
    return SamplingParams(temperature=t, top_k=3 if t else -1, seed=int(t * 10))


def test_rows_stay_put_when_others_leave() -> None:
    batch = InputBatch(max_num_reqs=4)
    for i, rid in enumerate("abcd"):
        assert batch.add(rid, _params(0.1 * (i + 1))) == i
    batch.remove("b")
    assert batch.req_id_to_row["c"] == 2 and batch.req_id_to_row["d"] == 3


def test_new_request_fills_the_lowest_hole_without_moving_anyone() -> None:
    batch = InputBatch(max_num_reqs=4)
    for rid in "abcd":
        batch.add(rid, _params(0.5))
    batch.remove("b")
    assert batch.add("e", _params(0.7)) == 1
    assert batch.condense() == []
    assert abs(float(batch.temperature[1]) - 0.7) < 1e-6


def test_condense_moves_only_the_top_rows_into_holes_with_their_parameters() -> None:
    batch = InputBatch(max_num_reqs=8)
    for i, rid in enumerate("abcdef"):
        batch.add(rid, _params(0.1 * (i + 1)))
    batch.remove("a")
    batch.remove("c")
    batch.remove("f")  # top row: just dropped, nothing moves for it
    moves = batch.condense()
    # three requests remain: rows 0..2; the two highest (e at 4, d at 3) fill holes 0 and 2
    assert moves == [(4, 0), (3, 2)]
    assert batch.req_ids == ["e", "b", "d"]
    assert batch.req_id_to_row == {"e": 0, "b": 1, "d": 2}
    assert abs(float(batch.temperature[0]) - 0.5) < 1e-6
    assert int(batch.seeds[0]) == 5


def test_condense_leaves_no_hole_below_the_end() -> None:
    batch = InputBatch(max_num_reqs=2)
    for i in range(10):
        batch.add(f"r{i}", _params(0.1))
    for i in (0, 2, 3, 7):
        batch.remove(f"r{i}")
    batch.condense()
    assert None not in batch.req_ids
    assert sorted(batch.req_id_to_row.values()) == list(range(6))
    assert all(batch.req_ids[row] == rid for rid, row in batch.req_id_to_row.items())
