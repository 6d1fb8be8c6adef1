"""The persistent input batch keeps rows put and moves as little as possible."""

from __future__ import annotations

import torch

from tandem.core.worker.input_batch import InputBatch
from tandem.schema.sampling_params import SamplingParams


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


# The persistent rows: tokens, ledger and blocks live in the batch and move with the row ---
def _add(batch: InputBatch, rid: str, tokens: list[int], blocks: list[int], computed: int = 0):
    return batch.add(
        rid,
        SamplingParams(temperature=0.0),
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        block_ids=blocks,
        num_computed_tokens=computed,
    )


def test_condense_moves_tokens_ledger_and_blocks_with_the_row() -> None:
    batch = InputBatch(max_num_reqs=4, max_num_tokens=4)
    _add(batch, "a", [1, 2], [7])
    _add(batch, "b", [3, 4, 5, 6, 7], [8, 9], computed=3)  # wider than 4: the table grows
    batch.remove("a")
    assert batch.condense() == [(1, 0)]
    assert batch.token_ids_of("b") == [3, 4, 5, 6, 7]
    assert int(batch.num_computed_tokens[0]) == 3
    assert batch.block_table.block_ids(0) == [8, 9]
    assert batch.block_table.num_blocks[1] == 0 and not bool(batch.block_table.table[1].any())


def test_blocks_are_appended_in_place() -> None:
    batch = InputBatch(max_num_reqs=2)
    row = _add(batch, "a", [1, 2, 3], [4])
    batch.block_table.append(row, [5, 6])
    batch.block_table.append(row, [])
    assert batch.block_table.block_ids(row) == [4, 5, 6]
    for i in range(40):  # past the initial width of the table
        batch.block_table.append(row, [100 + i])
    assert batch.block_table.block_ids(row) == [4, 5, 6, *range(100, 140)]


def test_sampled_tokens_append_and_rejected_drafts_roll_the_ledger_back() -> None:
    batch = InputBatch(max_num_reqs=2)
    a = _add(batch, "a", [1, 2, 3], [0])
    b = _add(batch, "b", [4, 5], [1])
    rows = torch.tensor([a, b])
    # The step computed a's last token plus 2 drafts, and b's last token plus 2 drafts.
    batch.num_computed_tokens[rows] = torch.tensor([5, 4])
    sampled = torch.tensor([[9, 8, 7], [6, -1, -1]])  # a: both drafts accepted; b: none
    batch.append_sampled(rows, sampled, torch.tensor([2, 2]))
    assert batch.token_ids_of("a") == [1, 2, 3, 9, 8, 7]
    assert batch.token_ids_of("b") == [4, 5, 6]
    assert batch.num_computed_tokens[rows].tolist() == [5, 2]  # every known token but the last
    assert batch.num_rejected[rows].tolist() == [0, 2]


def test_placeholders_are_appended_as_minus_one() -> None:
    batch = InputBatch(max_num_reqs=2, max_num_tokens=2)
    row = _add(batch, "a", [1, 2], [0])
    cols = batch.append_placeholders(torch.tensor([row]))
    assert cols.tolist() == [2]
    assert batch.token_ids_of("a") == [1, 2, -1]
    assert batch.num_output_tokens("a") == 1
