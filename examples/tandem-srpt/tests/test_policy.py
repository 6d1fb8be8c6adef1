"""The policy: short requests overtake long ones (vs FCFS on the reference scheduler), the
order follows the documented key, and aging bounds how long a long request waits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from _helpers import Run, queue_of, req, scheduler_of, srpt_stack
from tandem_srpt import overtaking_window, remaining_work, waiting_steps_bound

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
MAX_MODEL_LEN = 256


@MODES
@pytest.mark.parametrize("stack", ["srpt", "reference"])
def test_short_request_submitted_last_goes_first(
    scripted_engine_factory: Callable[..., Any], async_scheduling: bool, stack: str
) -> None:
    engine = scripted_engine_factory(
        plugins=srpt_stack() if stack == "srpt" else None,  # None: reference-scheduler
        async_scheduling=async_scheduling,
        max_num_seqs=1,
    )
    run = Run(engine)
    for request in (req("long-1", 24, 20), req("long-2", 20, 16), req("short", 4, 3)):
        run.add(request)
    run.run_until_idle()
    run.check_outputs(MAX_MODEL_LEN)
    if stack == "srpt":
        # Remaining work W: long-1 44, long-2 36, short 7; all arrived at step 0.
        assert run.admission_order == ["short", "long-2", "long-1"]
        assert run.finish_order == ["short", "long-2", "long-1"]
    else:
        assert run.admission_order == ["long-1", "long-2", "short"]  # FCFS
        assert run.finish_order == ["long-1", "long-2", "short"]


@MODES
def test_later_short_arrival_overtakes_only_inside_its_window(
    scripted_engine_factory: Callable[..., Any], async_scheduling: bool
) -> None:
    """long-2 waits from step 1 with W = 44: with aging_rate 4 a 7-token request overtakes
    it if it arrives before step 1 + (44 - 7) / 4 = 10.25, and not after."""
    for arrival, overtakes in ((3, True), (10, True), (11, False)):
        engine = scripted_engine_factory(
            plugins=srpt_stack(4.0), async_scheduling=async_scheduling, max_num_seqs=1
        )
        run = Run(engine)
        run.add(req("long-1", 20, 40))  # holds the only seat for 40+ steps
        run.step_once()
        run.add(req("long-2", 20, 24))
        while run.step < arrival:
            run.step_once()
        run.add(req("short", 4, 3))
        queue = queue_of(engine)
        keys = {r.request_id: queue.key(r) for r in queue}
        assert list(keys) == (["short", "long-2"] if overtakes else ["long-2", "short"])
        run.run_until_idle()
        run.check_outputs(MAX_MODEL_LEN)
        assert run.admission_order[0] == "long-1"
        expected = ["short", "long-2"] if overtakes else ["long-2", "short"]
        assert run.admission_order[1:] == expected, (arrival, run.admitted)


def starve(engine: Any, stream_steps: int) -> Run:
    """Two short requests fill both seats, then a long one arrives, then one short request
    arrives every step for `stream_steps` steps (more than two seats can serve)."""
    run = Run(engine)
    run.add(req("s-a", 4, 4))
    run.add(req("s-b", 4, 4))
    long = req("long", 12, 20)
    assert remaining_work(long, MAX_MODEL_LEN) == 32
    run.add(long)
    for i in range(stream_steps):
        run.add(req(f"s{i}", 4, 4))
        run.step_once()
    return run


@MODES
def test_aging_bounds_the_wait_of_a_long_request(
    scripted_engine_factory: Callable[..., Any], async_scheduling: bool
) -> None:
    aging_rate = 4.0
    engine = scripted_engine_factory(
        plugins=srpt_stack(aging_rate), async_scheduling=async_scheduling, max_num_seqs=2
    )
    run = starve(engine, stream_steps=60)
    assert "long" in run.admitted, "the long request starved"
    waited = run.admitted["long"] - run.arrived["long"]
    w_long = 32  # remaining_work of the fresh request: 12 prompt + 20 output tokens
    # The documented bound: 2 requests already waiting when it arrives, one arrival per
    # step, and a head of WAITING admitted at least every c steps: a 4-token request holds
    # its seat for 4 schedule calls in the synchronous loop, 5 under async scheduling (its
    # last step's result is processed one call later), and there are 2 seats.
    c = 5 if async_scheduling else 4
    bound = waiting_steps_bound(
        w_long, aging_rate, already_waiting=2, arrivals_per_step=1, admission_interval=c
    )
    assert overtaking_window(w_long, aging_rate) == 8
    assert bound == c * 11 - 1
    assert 0 < waited <= bound, (waited, run.admitted)
    # Exactly the short requests with a smaller virtual deadline went first: s0..s5
    # (d = 8 + 4 * i < 32); s6 (d = 32, a tie) and every later arrival went after.
    before = {rid for rid, t in run.admitted.items() if t < run.admitted["long"]}
    assert before == {"s-a", "s-b"} | {f"s{i}" for i in range(6)}
    window_end = run.arrived["long"] + overtaking_window(w_long, aging_rate)
    late = [rid for rid, s in run.arrived.items() if s >= window_end]
    assert late and not before & set(late)
    run.run_until_idle()
    run.check_outputs(MAX_MODEL_LEN)


@MODES
def test_without_aging_the_long_request_starves(
    scripted_engine_factory: Callable[..., Any], async_scheduling: bool
) -> None:
    """Control: with negligible aging (pure SRPT) the same stream starves it."""
    engine = scripted_engine_factory(
        plugins=srpt_stack(1e-6), async_scheduling=async_scheduling, max_num_seqs=2
    )
    run = starve(engine, stream_steps=60)
    assert "long" not in run.admitted
    run.run_until_idle()  # once the stream stops it runs
    run.check_outputs(MAX_MODEL_LEN)


@MODES
def test_first_admissions_follow_the_virtual_deadline(
    scripted_engine_factory: Callable[..., Any], async_scheduling: bool
) -> None:
    """Whenever X is admitted while R waits, d(X) <= d(R): the order is the documented
    key, also with preemption and chunked prefill in the way."""
    aging_rate = 3.0
    engine = scripted_engine_factory(
        plugins=srpt_stack(aging_rate),
        async_scheduling=async_scheduling,
        max_model_len=128,
        max_num_batched_tokens=20,
        long_prefill_token_threshold=12,
        max_num_seqs=3,
        num_kv_blocks=32,
    )
    run = Run(engine)
    sizes = [(30, 20), (3, 5), (50, 10), (8, 2), (5, 30), (20, 6), (2, 2), (40, 40), (6, 9)]
    deadline: dict[str, float] = {}
    for i in range(27):
        if i % 2 == 0 or i < 6:
            prompt_len, max_tokens = sizes[i % len(sizes)]
            request = req(f"r{i}", prompt_len, max_tokens)
            run.add(request)
            w = remaining_work(request, 128)
            deadline[request.request_id] = w + aging_rate * run.arrived[request.request_id]
        run.step_once()
    run.run_until_idle()
    run.check_outputs(128)
    assert scheduler_of(engine).num_preemptions > 0
    for x, t in run.admitted.items():
        for r, s in run.arrived.items():
            if s <= t < run.admitted[r]:  # R was waiting when X was admitted
                assert deadline[x] <= deadline[r], (x, r, run.admitted, run.arrived)
