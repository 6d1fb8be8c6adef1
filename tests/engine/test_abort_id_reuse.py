"""An abort targets the request that has the id when `abort_requests` is called.

A request id may be reused once its request finished. An abort queued for the finished
request (too late, or racing with its last step) must never end the later request with the
same id, and aborting one request twice reports one abort.
"""

from __future__ import annotations

import pytest

from tandem.core.engine_core import EngineCore
from tandem.core.outputs import EngineCoreOutput
from tandem.schema.sampling_params import SamplingParams
from tandem.testing import collect_outputs, expected_scripted_output, make_request
from tandem.testing import make_scripted_engine as make_engine

FIRST, SECOND = [2, 3, 5], [7, 5, 3, 2]


def expected(prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return expected_scripted_output(prompt, params, 128, 1, 256)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_after_the_request_finished_does_not_end_a_new_request_with_its_id(
    async_scheduling: bool,
) -> None:
    engine = make_engine(async_scheduling=async_scheduling)
    engine.add_request(make_request("A", FIRST, max_tokens=2, ignore_eos=True))
    assert collect_outputs(engine)["A"] == expected(FIRST, 2)

    engine.abort_requests(["A"])  # too late: A has finished
    engine.add_request(make_request("A", SECOND, max_tokens=5, ignore_eos=True))
    assert collect_outputs(engine)["A"] == expected(SECOND, 5)


def test_abort_queued_while_the_request_ran_does_not_end_its_successor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The abort arrives (as from another thread) after the last drain before the update
    that finishes A: A is live when it is queued, but finished when it would be drained.
    The new A, added before that drain, must run to its end."""
    engine = make_engine(async_scheduling=False)
    engine.add_request(make_request("A", FIRST, max_tokens=1, ignore_eos=True))
    update = engine._update_from_output

    def abort_then_update(*args: object) -> list[EngineCoreOutput]:
        engine.abort_requests(["A"])
        return update(*args)

    monkeypatch.setattr(engine, "_update_from_output", abort_then_update)
    outputs, _ = engine.step_fn()
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [expected(FIRST, 1)]
    monkeypatch.setattr(engine, "_update_from_output", update)

    engine.add_request(make_request("A", SECOND, max_tokens=5, ignore_eos=True))
    assert collect_outputs(engine)["A"] == expected(SECOND, 5)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_aborting_a_request_twice_reports_one_abort(async_scheduling: bool) -> None:
    engine = make_engine(async_scheduling=async_scheduling)
    engine.add_request(make_request("A", FIRST, max_tokens=20, ignore_eos=True))
    engine.add_request(make_request("B", SECOND, max_tokens=4, ignore_eos=True))
    first, _ = engine.step_fn()
    engine.abort_requests(["A", "A"])
    engine.abort_requests(["A"])
    outputs = collect_outputs(engine)  # fails on any output after a finish
    assert outputs["A"][1] == "abort"
    b_first = [t for o in first if o.request_id == "B" for t in o.new_token_ids]
    assert (b_first + outputs["B"][0], outputs["B"][1]) == expected(SECOND, 4)


def test_abort_of_an_id_never_added_is_ignored() -> None:
    engine: EngineCore = make_engine()
    engine.abort_requests(["ghost"])
    engine.add_request(make_request("ghost", FIRST, max_tokens=3, ignore_eos=True))
    assert collect_outputs(engine)["ghost"] == expected(FIRST, 3)
