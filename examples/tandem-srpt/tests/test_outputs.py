"""SRPT changes order, never tokens: greedy outputs equal the scripted model's reference
under sync and async scheduling, with preemption (small KV pool), chunked prefill (small
token budget and `long_prefill_token_threshold`) and prefix caching."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from tandem.testing import make_request

from _helpers import Run, expected, prompt, queue_of, req, scheduler_of, srpt_stack

MAX_MODEL_LEN = 128


def workload() -> list[tuple[int, Any]]:
    """(arrival step, request): long and short requests, a shared prefix, EOS allowed on some."""
    shared = prompt("shared", 20)
    items: list[tuple[int, Any]] = []
    for i in range(14):
        prompt_len = (3, 41, 7, 26, 12, 55)[i % 6]
        max_tokens = (30, 4, 17, 9, 40, 2)[i % 6]
        items.append((i // 3 * 2, req(f"r{i}", prompt_len, max_tokens)))
    items.append((1, make_request("eos-a", shared + [5, 9], max_tokens=60)))
    items.append((3, make_request("eos-b", shared + [7], max_tokens=60)))
    return items


@pytest.mark.parametrize("executor", ["inprocess", "thread"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("aging_rate", [2.0, 64.0])
def test_outputs_equal_the_reference(
    scripted_engine_factory: Callable[..., Any],
    async_scheduling: bool,
    executor: str,
    aging_rate: float,
) -> None:
    engine = scripted_engine_factory(
        plugins=srpt_stack(aging_rate),
        async_scheduling=async_scheduling,
        parallel={"executor": executor},
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=24,
        long_prefill_token_threshold=16,
        max_num_seqs=6,
        num_kv_blocks=36,  # 144 slots: far fewer than the workload needs at once
        enable_prefix_caching=True,
    )
    assert engine.config.scheduler.async_scheduling is async_scheduling
    run = Run(engine)
    pending = sorted(workload(), key=lambda item: item[0])
    while pending or engine.has_work():
        while pending and pending[0][0] <= run.step:
            run.add(pending.pop(0)[1])
        run.step_once()
        assert run.step < 2000
    run.check_outputs(MAX_MODEL_LEN)
    assert run.admission_order != list(run.requests), "SRPT should not admit in FCFS order"
    assert scheduler_of(engine).num_preemptions > 0, "the workload should preempt"
    assert len(queue_of(engine).arrival_steps) == 0  # nothing leaks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_aborts_of_waiting_and_running_requests(
    scripted_engine_factory: Callable[..., Any], async_scheduling: bool
) -> None:
    engine = scripted_engine_factory(
        plugins=srpt_stack(), async_scheduling=async_scheduling, max_num_seqs=1
    )
    queue = queue_of(engine)
    run = Run(engine)
    for request in (req("b", 10, 30), req("c", 20, 25), req("a", 6, 20)):
        run.add(request)
    run.step_once()  # remaining work: a 26 (admitted), b 40, c 45 (waiting)
    run.step_once()
    assert run.admission_order == ["a"]
    assert [r.request_id for r in queue] == ["b", "c"]
    engine.abort_requests(["a", "b"])  # one running, one waiting
    run.run_until_idle()
    assert run.finish_reasons == {"a": "abort", "b": "abort", "c": "length"}
    assert (run.tokens["c"], run.finish_reasons["c"]) == expected(run.requests["c"], 256)
    assert queue.arrival_steps == {} and len(queue) == 0
