"""`tandem simulate`'s engine side: one clock, the virtual device, the token oracle, and the
real plugin objects driven on simulated time."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from tandem.core import hookimpl
from tandem.core.clock import VirtualClock
from tandem.core.engine_core import EngineCore
from tandem.core.plugin_manager import TandemPlugin
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.step_shape import StepShape
from tandem.core.worker.virtual_device import EngineTime, VirtualDeviceExecutor
from tandem.simulate.driver import make_request, simulate, simulation_config
from tandem.simulate.report import Slo, summarize
from tandem.simulate.traffic import ClosedLoopClients, TrafficRequest, parse_traffic
from tandem.stack_file import load_config


def scripted(**overrides: Any):  # noqa: ANN201
    settings: dict[str, Any] = dict(
        model="scripted",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=16,
        num_kv_blocks=48,
    )
    return load_config(**(settings | overrides))


def burst_then_trickle(n: int = 24) -> list[TrafficRequest]:
    """Mixed lengths: a burst at 0 (queueing and preemption in a small pool), then a trickle."""
    out = []
    for i in range(n):
        arrival = 0.0 if i < n // 2 else 0.01 * (i - n // 2)
        out.append(TrafficRequest(arrival, 20 + 13 * (i % 5), 4 + 20 * (i % 3), priority=i % 2))
    return out


def token_counts(result: Any) -> dict[str, tuple[int, str | None]]:
    return {t.request_id: (len(t.token_times_s), t.finish_reason) for t in result.timelines}


class RecordingClockUser(TandemPlugin):
    """Remembers the clock it was given and every step's scheduled tokens."""

    seen: ClassVar[list[Any]] = []

    @hookimpl
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        RecordingClockUser.seen.append((self.clock, dict(scheduler_output.num_scheduled_tokens)))


class FixedCost(TandemPlugin):
    """A cost model: every step costs 1 ms per scheduled token."""

    @hookimpl
    def step_cost(self, step: StepShape) -> float:
        return 1e-3 * step.num_tokens


def test_every_plugin_gets_the_engine_clock() -> None:
    clock = VirtualClock(5.0)
    config = simulation_config(
        scripted(
            plugins=["reference-scheduler", "default-sampler", f"{__name__}:RecordingClockUser"]
        )
    )
    engine = EngineCore(config, executor=VirtualDeviceExecutor(config, clock), clock=clock)
    try:
        RecordingClockUser.seen.clear()
        engine.add_request(make_request(TrafficRequest(0.0, 10, 3), 0, 128, 1, 0))
        engine.run_until_idle()
        assert RecordingClockUser.seen and all(c is clock for c, _ in RecordingClockUser.seen)
        for plugin in engine.plugin_manager.get_plugins():
            assert plugin.clock is clock
    finally:
        engine.shutdown()


def test_virtual_clock_never_goes_back() -> None:
    clock = VirtualClock()
    clock.advance_to(2.0)
    clock.advance_to(2.0 - 1e-12)  # rounding: ignored
    assert clock.now() == 2.0
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance_to(1.0)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_token_oracle_schedules_exactly_as_the_worker(async_scheduling: bool) -> None:
    """Same timelines (token times, finishes, preemptions) from the oracle and from the
    scripted model through the real worker, with prefix caching and a pool small enough
    to preempt."""
    config = scripted(
        async_scheduling=async_scheduling, enable_prefix_caching=True, num_kv_blocks=24
    )
    traffic = burst_then_trickle()
    runs = [
        simulate(
            config, traffic, tokens=tokens, engine_time=EngineTime(step_s=2e-4), keep_steps=True
        )
        for tokens in ("worker", "oracle")
    ]
    worker, oracle = runs
    assert worker.num_preemptions > 0  # the pool is small enough to matter
    assert [(s.num_scheduled_tokens, s.preempted) for s in worker.steps] == [
        (s.num_scheduled_tokens, s.preempted) for s in oracle.steps
    ]
    assert [t.token_times_s for t in worker.timelines] == [
        t.token_times_s for t in oracle.timelines
    ]
    assert all(reason == "length" for _, reason in token_counts(oracle).values())


def test_simulated_and_real_engines_make_the_same_decisions() -> None:
    """Replaying the simulation's arrivals at the same engine calls into a real engine
    (in-process executor, the scripted model through the worker, the wall clock) gives the
    same sequence of scheduler outputs."""
    config = scripted(
        plugins=["reference-scheduler", "default-sampler", f"{__name__}:RecordingClockUser"]
    )
    traffic = burst_then_trickle()
    RecordingClockUser.seen.clear()
    sim = simulate(config, traffic, engine_time=EngineTime(step_s=1e-3))
    simulated = [steps for _, steps in RecordingClockUser.seen if steps]
    real_config = simulation_config(config)
    real_config.parallel.executor = "inprocess"
    engine = EngineCore(real_config)
    RecordingClockUser.seen.clear()
    by_call: dict[int, list[int]] = {}
    for rid, calls in sim.added_after_calls.items():
        by_call.setdefault(calls, []).append(int(rid.removeprefix("sim-")))
    try:
        for call in range(10_000):
            for i in by_call.pop(call, []):
                engine.add_request(make_request(traffic[i], i, 128, 1, 0))
            if not by_call and not engine.has_work():
                break
            engine.step_fn()
    finally:
        engine.shutdown()
    real = [steps for _, steps in RecordingClockUser.seen if steps]
    assert len(simulated) > 20 and real == simulated


def test_a_different_policy_plugin_changes_the_simulated_result() -> None:
    """The simulation runs the stack's own plugins: SRPT (the example package) serves the
    short requests of a burst first, so their mean latency drops against FCFS."""
    traffic = [TrafficRequest(0.0, 32, 64 if i % 2 else 4) for i in range(16)]
    fcfs = simulate(scripted(max_num_seqs=2), traffic, engine_time=EngineTime(step_s=1e-3))
    srpt = simulate(
        scripted(max_num_seqs=2, plugins=["reference-scheduler", "srpt-order", "default-sampler"]),
        traffic,
        engine_time=EngineTime(step_s=1e-3),
    )
    slo = Slo()
    mean_e2e = [
        summarize(r.timelines, duration_s=r.duration_s, slo=slo)["e2e_ms"]["mean"]
        for r in (fcfs, srpt)
    ]
    assert mean_e2e[1] < 0.8 * mean_e2e[0]


def test_async_overlap_falls_out_of_the_event_order() -> None:
    """With engine time per step, async scheduling hides it behind the device: the same
    traffic finishes sooner and keeps the device busier than under sync scheduling."""
    traffic = [TrafficRequest(0.0, 16, 32) for _ in range(8)]
    runs = {
        mode: simulate(
            scripted(async_scheduling=mode, plugins=None),
            traffic,
            engine_time=EngineTime(step_s=2e-3),
        )
        for mode in (False, True)
    }
    sync, asyn = runs[False], runs[True]
    assert asyn.duration_s < 0.8 * sync.duration_s
    assert asyn.busy_s / asyn.duration_s > sync.busy_s / sync.duration_s


def test_a_cost_model_plugin_sets_the_step_time() -> None:
    traffic = [TrafficRequest(0.0, 10, 5)]
    config = scripted(plugins=["reference-scheduler", "default-sampler", f"{__name__}:FixedCost"])
    result = simulate(config, traffic)
    # 10 prompt tokens (one step, 10 ms), then 4 decode steps of 1 ms; no engine time.
    assert result.busy_s == pytest.approx(0.014)
    assert result.timelines[0].token_times_s == pytest.approx([0.010, 0.011, 0.012, 0.013, 0.014])


def test_closed_loop_clients_keep_at_most_their_count_in_flight() -> None:
    spec = parse_traffic("closed:clients=3,think=0.01,n=12,prompt=16,output=8,seed=2")
    result = simulate(scripted(), ClosedLoopClients(spec, 256), engine_time=EngineTime(step_s=1e-3))
    assert len(result.timelines) == 12
    events = sorted(
        [(t.arrival_s, 1) for t in result.timelines] + [(t.finish_s, -1) for t in result.timelines]
    )
    in_flight, peak = 0, 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    assert peak <= 3


def test_engine_time_modes_are_checked() -> None:
    with pytest.raises(ValueError, match="engine_time.mode"):
        EngineTime(mode="guess")
    with pytest.raises(ValueError, match="output_s"):
        EngineTime(output_s=-1.0)


def test_output_time_delays_what_the_client_sees_not_the_engine() -> None:
    """`output_s` shifts every token and finish by itself (the front end's hop) and
    changes nothing the engine does: the device spans, busy time and steps are the same."""
    traffic = [TrafficRequest(0.0, 10, 5), TrafficRequest(0.003, 6, 4)]
    config = scripted(plugins=["reference-scheduler", "default-sampler", f"{__name__}:FixedCost"])
    plain = simulate(config, traffic, engine_time=EngineTime(step_s=1e-3), keep_steps=True)
    hop = simulate(
        config, traffic, engine_time=EngineTime(step_s=1e-3, output_s=0.004), keep_steps=True
    )
    assert [(s.start_s, s.end_s) for s in hop.steps] == [(s.start_s, s.end_s) for s in plain.steps]
    assert hop.busy_s == plain.busy_s and hop.num_steps == plain.num_steps
    for a, b in zip(plain.timelines, hop.timelines, strict=True):
        assert b.token_times_s == pytest.approx([t + 0.004 for t in a.token_times_s])
        assert b.finish_s == pytest.approx(a.finish_s + 0.004)
    ttft = [
        summarize(r.timelines, duration_s=r.duration_s, slo=Slo())["ttft_ms"]["p50"]
        for r in (plain, hop)
    ]
    assert ttft[1] == pytest.approx(ttft[0] + 4.0)


def test_a_closed_loop_client_sends_after_it_sees_the_finish() -> None:
    """A closed-loop client's next request arrives `output_s` plus its think time after the
    engine finished the previous one."""
    spec = parse_traffic("closed:clients=1,think=0.0,n=3,prompt=16,output=4,seed=0")
    result = simulate(
        scripted(), ClosedLoopClients(spec, 256), engine_time=EngineTime(output_s=0.01)
    )
    ordered = sorted(result.timelines, key=lambda t: t.arrival_s)
    for previous, following in zip(ordered, ordered[1:], strict=False):
        assert previous.finish_s is not None
        assert following.arrival_s == pytest.approx(previous.finish_s)
        assert following.arrival_s >= previous.token_times_s[-1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_acceptance_model_sets_tokens_per_step(async_scheduling: bool) -> None:
    """The oracle proposes `num_speculative_tokens` drafts and accepts each with the given
    probability: all accepted, a decode step yields 4 tokens; none, 1; every request still
    gets exactly its output length."""
    config = scripted(
        max_num_batched_tokens=256,
        async_scheduling=async_scheduling,
        speculative={"method": "ngram", "num_speculative_tokens": 3},
    )
    traffic = [TrafficRequest(0.0, 32, 40) for _ in range(4)]
    steps = {}
    for rate in (0.0, 0.7, 1.0):
        result = simulate(
            config, traffic, acceptance_rate=rate, engine_time=EngineTime(step_s=1e-4)
        )
        assert [len(t.token_times_s) for t in result.timelines] == [40] * 4
        steps[rate] = result.num_steps
    assert steps[0.0] == 40  # one prefill step, then 39 decode steps of one token
    assert steps[1.0] <= 12  # one prefill step, then 4 tokens per step
    assert steps[1.0] < steps[0.7] < steps[0.0]
