"""`grammar_bitmask` for a step whose sampling was deferred, when a constrained request of
that step left before the bitmask was asked for (hookspec contract: its rows still come,
all ones; the backend must not look it up).

Under async scheduling a step holding a constrained request with a token in flight waits to
sample until the previous step is applied. Between its scheduling and its bitmask, the
aborts queue is drained and the previous step's results are applied: the request can be
aborted or stop there. The test kit's `fake-grammar` follows the contract (it raised
KeyError before).
"""

from __future__ import annotations

from typing import Any

import pytest

from tandem.core.engine_core import EngineCore
from tandem.core.scheduler_output import SchedulerOutput
from tandem.testing import collect_outputs, make_request, make_scripted_engine

PLUGINS = [{"name": "reference-scheduler"}, {"name": "default-sampler"}, {"name": "fake-grammar"}]
GRAMMAR = {"custom": {"modulus": 3}}


def make_engine(async_scheduling: bool) -> EngineCore:
    engine = make_scripted_engine(
        async_scheduling=async_scheduling, plugins=PLUGINS, max_model_len=64, num_kv_blocks=32
    )
    engine.add_request(
        make_request("a", [3, 4, 5], max_tokens=30, ignore_eos=True, structured_outputs=GRAMMAR)
    )
    engine.add_request(
        make_request("b", [7, 7, 2], max_tokens=12, ignore_eos=True, structured_outputs=GRAMMAR)
    )
    return engine


def test_request_aborted_while_its_sampling_is_deferred(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(async_scheduling=True)
    execute = engine.executor.execute_model
    deferred_with_a: list[int] = []

    def execute_then_abort(scheduler_output: SchedulerOutput) -> Any:
        future = execute(scheduler_output)
        if (
            not deferred_with_a
            and scheduler_output.pending_structured_output_tokens
            and "a" in scheduler_output.structured_output_request_ids
            and scheduler_output.step_id >= 4
        ):
            deferred_with_a.append(scheduler_output.step_id)
            engine.abort_requests(["a"])  # drained before the bitmask of this step
        return future

    monkeypatch.setattr(engine.executor, "execute_model", execute_then_abort)
    outputs = collect_outputs(engine)
    assert deferred_with_a, "no deferred step held the constrained request"
    tokens, reason = outputs["a"]
    assert reason == "abort"

    reference = collect_outputs(make_engine(async_scheduling=False))
    assert outputs["b"] == reference["b"]
    assert tokens == reference["a"][0][: len(tokens)]
    kv = engine.scheduler_state.kv_cache_manager
    assert kv.all_blocks_free()
