"""The n-gram drafter's rule against a plain-Python reference: the longest n in
[min, max] whose suffix occurs earlier, its most recent occurrence, up to k following
tokens; prefill chunks get no drafts; histories are appended incrementally and rebuilt
when they change."""

from __future__ import annotations

import random

import pytest

from tandem.core.worker.draft_context import DraftContext
from tandem.spec_decode.ngram import NgramDrafter
from tandem.stack_file import load_config


def drafter(k: int = 3, min_n: int = 1, max_n: int = 3) -> NgramDrafter:
    config = load_config(
        None,
        model="scripted",
        speculative={
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": min_n,
            "prompt_lookup_max": max_n,
        },
    )
    return NgramDrafter(config, None)  # type: ignore[arg-type]


def reference(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule, one candidate at a time."""
    length = len(history)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = history[length - n :]
        for end in range(length - 1, n - 1, -1):  # most recent first
            if history[end - n : end] == suffix:
                return history[end : min(end + k, length)]
    return []


def propose(d: NgramDrafter, histories: dict[str, list[int]], k: int) -> dict[str, list[int]]:
    ids = list(histories)
    out = d.propose_drafts(
        DraftContext(ids, [histories[r] for r in ids], [[histories[r][-1]] for r in ids], k)
    )
    return dict(zip(ids, out, strict=True))


def test_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    # suffix [5, 6, 7]: the 3-gram occurs at the start (followed by 8, 9); the 1-gram [7]
    # occurs more recently (followed by 2). Longest wins.
    history = [5, 6, 7, 8, 9, 1, 7, 2, 3, 5, 6, 7]
    assert propose(drafter(), {"a": history}, 3) == {"a": [8, 9, 1]}


def test_most_recent_occurrence_of_the_longest_match() -> None:
    history = [5, 6, 7, 8, 1, 5, 6, 7, 9, 4, 5, 6, 7]
    assert propose(drafter(), {"a": history}, 3) == {"a": [9, 4, 5]}


def test_proposal_stops_at_the_end_of_the_history() -> None:
    assert propose(drafter(k=5), {"a": [1, 2, 3, 1, 2]}, 5) == {"a": [3, 1, 2]}


def test_no_match_or_too_short_gives_no_drafts() -> None:
    d = drafter(min_n=2)
    assert propose(d, {"a": [1, 2, 3, 4], "b": [9, 9, 8, 9]}, 3) == {"a": [], "b": []}


def test_prefill_chunk_gets_no_drafts() -> None:
    d = drafter()
    out = d.propose_drafts(DraftContext(["a", "b"], [[1, 2, 1, 2], [3, 4, 3]], [[], [3]], 3))
    assert out == [[], [4, 3]]


@pytest.mark.parametrize("min_n,max_n,k", [(1, 3, 3), (2, 4, 5), (1, 1, 2), (3, 5, 4)])
def test_random_histories_match_the_reference_while_growing(min_n: int, max_n: int, k: int) -> None:
    """Small alphabets so matches of every length occur; histories grow between calls, one
    is replaced (as after a preemption with different content) and rebuilt."""
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    d = drafter(k, min_n, max_n)
    histories = {f"r{i}": [rng.randrange(4) for _ in range(rng.randint(1, 40))] for i in range(9)}
    checked = 0
    for step in range(30):
        for h in histories.values():
            h.extend(rng.randrange(4) for _ in range(rng.randint(1, k + 1)))
        if step == 10:
            histories["r3"] = [rng.randrange(4) for _ in range(7)]
        got = propose(d, histories, k)
        for rid, h in histories.items():
            assert got[rid] == reference(h, k, min_n, max_n), (rid, h)
            checked += bool(got[rid])
    assert checked > 100  # the test exercised real proposals


def test_context_may_ask_for_fewer_drafts_than_configured() -> None:
    assert propose(drafter(k=4), {"a": [1, 2, 3, 4, 1]}, 2) == {"a": [2, 3]}


def test_rows_of_finished_requests_are_released() -> None:
    """A request the runner reports finished (or preempted) gives its buffer row back at
    the next call; the row is reused by the next new request."""
    d = drafter()
    history = [5, 6, 7, 5, 6]
    d.propose_drafts(
        DraftContext(req_ids=["a"], token_ids=[history], sampled_token_ids=[[6]], num_spec_tokens=3)
    )
    slot = d._slot["a"]
    out = d.propose_drafts(
        DraftContext(
            req_ids=["b"],
            token_ids=[history],
            sampled_token_ids=[[6]],
            num_spec_tokens=3,
            finished_req_ids=["a"],
        )
    )
    assert "a" not in d._slot
    assert d._slot["b"] == slot  # the freed row is the next one handed out
    assert out == [reference(history, 3, 1, 3)]
