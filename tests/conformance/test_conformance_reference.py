"""The reference scheduler passes every conformance check, sync and async, and the
workloads really exercise what each check is about (preemption happens, aborts hit
requests that were running, a queue forms under steady arrivals). Also: the waiting bound's
formula and regime, and the `reference_outputs` / `ledger_trace` fixtures."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from tandem.testing.conformance import (
    CHECK_LIST,
    CHECKS,
    MODES,
    ConformanceReport,
    RequestSpec,
    Workload,
    check_wait_bound_regime,
    format_ledger_trace,
    run_conformance,
    wait_bound,
)
from tandem.testing.engine import expected_scripted_output, make_request


@pytest.fixture(scope="module")
def report() -> ConformanceReport:
    return run_conformance("reference-scheduler")


def test_reference_scheduler_passes_every_check(report: ConformanceReport) -> None:
    assert report.passed, report.summary()
    assert [(r.check, r.mode) for r in report.results] == [(c, m) for c in CHECKS for m in MODES]


@pytest.mark.parametrize("mode", MODES)
def test_the_workloads_exercise_their_checks(report: ConformanceReport, mode: str) -> None:
    assert report.result("preemption", mode).details["preemptions"] > 0
    assert report.result("ledger-invariants", mode).details["preemptions"] > 0
    abort = report.result("abort", mode).details
    assert abort["aborted_after_scheduling"] >= 4, abort
    assert abort["preemptions"] > 0, abort
    assert report.result("victim-starvation", mode).details["preemptions"] > 0
    # A real queue forms, and the reference stays within the bound.
    ratio = report.result("bounded-wait", mode).details["max_wait_ratio"]
    assert 0.25 < ratio <= 1.0, ratio


def test_wait_bound_formula() -> None:
    workload = next(c for c in CHECK_LIST if c.name == "bounded-wait").workloads[0]
    check_wait_bound_regime(workload)
    limits = workload.limits
    seqs, budget = limits["max_num_seqs"], limits["max_num_batched_tokens"]
    prompt, max_tokens = workload.max_prompt_len(), workload.max_max_tokens()
    for n in (0, 1, 4, 9):
        for use_async, a in ((False, 0), (True, 1)):
            want = -(-n * prompt // (budget - seqs + 1)) + n * (max_tokens + a) // seqs
            assert wait_bound(n, workload, use_async) == want
    assert wait_bound(0, workload, True) == 0  # an empty engine schedules at once


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scheduling_policy": "priority"}, "fcfs"),
        ({"max_num_batched_tokens": 4}, "S \\+ 1"),
        ({"num_kv_blocks": 16}, "blocks"),
        ({"long_prefill_token_threshold": 4}, "threshold"),
    ],
)
def test_wait_bound_regime_is_enforced(change: dict[str, Any], message: str) -> None:
    workload = next(c for c in CHECK_LIST if c.name == "bounded-wait").workloads[0]
    broken = replace(workload, limits={**workload.limits, **change})
    with pytest.raises(ValueError, match=message):
        check_wait_bound_regime(broken)


def test_reference_outputs_fixture(reference_outputs: Callable[..., Any]) -> None:
    workload = Workload(
        "tiny",
        (
            RequestSpec("g", (3, 5, 7), max_tokens=5),
            RequestSpec("s", (3, 5, 7), max_tokens=5, temperature=0.8, seed=7, arrival=1),
        ),
        {"max_model_len": 32, "block_size": 4, "num_kv_blocks": 16},
    )
    sync = reference_outputs(workload)
    params = make_request("g", [3, 5, 7], max_tokens=5).sampling_params
    assert sync["g"] == expected_scripted_output([3, 5, 7], params, 128, 1, 32)
    assert reference_outputs(workload, "async") == sync  # seeded sampling ignores timing


def test_ledger_trace_fixture(
    scripted_engine_factory: Callable[..., Any], ledger_trace: Callable[..., Any]
) -> None:
    engine = scripted_engine_factory(async_scheduling=True, num_kv_blocks=16, max_model_len=32)
    engine.add_request(make_request("r", [3, 4, 5, 6], max_tokens=3, ignore_eos=True))
    trace = ledger_trace(engine)
    assert trace[0].scheduled == {"r": 4}
    assert trace[0].ledgers["r"]["num_output_placeholders"] == 1  # async: one in flight
    assert [t for step in trace for out in step.outputs for t in out.new_token_ids]
    finished = [out for step in trace for out in step.outputs if out.finish_reason]
    assert [(out.request_id, out.finish_reason) for out in finished] == [("r", "length")]
    assert trace[-1].ledgers == {}  # finished requests leave the scheduler
    dump = format_ledger_trace(trace)
    assert "step 1: scheduled {'r': 4}" in dump and "num_output_placeholders" in dump
