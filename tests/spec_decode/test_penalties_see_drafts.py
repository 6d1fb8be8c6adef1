"""Penalties and bad words at a draft row see the drafts before it (the row is only used
when they were accepted, so they are its real history): greedy outputs with n-gram drafts
equal those without, sync and async, on the scripted model."""

from __future__ import annotations

from typing import Any, cast

import pytest

from tandem.plugins.reference_scheduler import ReferenceScheduler
from tandem.testing.engine import collect_outputs, make_request, make_scripted_engine

VOCAB = 5
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def prompt(i: int) -> list[int]:
    return ([2, 3, 4, 2 + i % 3, 0] * 6)[: 12 + i]


def run(params: dict[str, Any], spec: bool, async_scheduling: bool) -> tuple[Any, int]:
    engine = make_scripted_engine(
        vocab_size=VOCAB,
        eos_token_id=1,
        speculative=SPEC if spec else None,
        async_scheduling=async_scheduling,
    )
    for i in range(6):
        engine.add_request(
            make_request(f"r{i}", prompt(i), max_tokens=30, ignore_eos=True, **params)
        )
    out = collect_outputs(engine)
    scheduler = cast(ReferenceScheduler, engine.plugin_manager.plugins_with_role("scheduler")[0])
    return out, scheduler.spec_metrics.num_accepted_tokens


CASES = {
    # The scripted logit peak is 8 over a ripple in [0, 2): only a count-based penalty moves
    # the argmax (presence and repetition are capped too low to). Every penalty reads the
    # same per-row histories, which is what this checks.
    "frequency": {"frequency_penalty": 1.5},
    "frequency_and_presence": {"frequency_penalty": 1.0, "presence_penalty": 2.0},
    "bad_words": {"bad_words_token_ids": [[3, 4], [0, 2, 3], [2, 2]]},
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_penalised_greedy_outputs_equal_no_speculation(case: str, async_scheduling: bool) -> None:
    params = CASES[case]
    plain, _ = run({}, spec=False, async_scheduling=False)
    want, _ = run(params, spec=False, async_scheduling=False)
    assert want != plain  # the penalty really changes the outputs
    got, accepted = run(params, spec=True, async_scheduling=async_scheduling)
    assert accepted > 0
    assert got == want
