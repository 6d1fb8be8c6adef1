"""One simulation: a resolved stack, a traffic list, a virtual clock; the real engine loop.

`simulate` builds the very `EngineCore` a server would (the stack's plugin objects, the
engine's own `step_fn`: `step` or `step_with_batch_queue`), with a `VirtualDeviceExecutor`
and a `VirtualClock` in place of the model and the wall clock. It then interleaves two
event sources: arrivals (added when the clock reaches them; `Request.arrival_time` is the
arrival's simulated time) and engine steps (each moves the clock to its step's end through
the step's future). When the engine has nothing to run the clock jumps to the next
arrival; when it has work but nothing runnable (every request held back by a plugin) it
jumps to the plugins' next announced event, e.g. a grammar compile finishing on the
virtual clock (`plugin_events`), or to an earlier arrival. Output tokens are stamped with
the clock when `step_fn` returns them, plus `EngineTime.output_s` (the front end's hop to
the client, 0 by default), as a client would see them.

Bounded: at most `max_steps` engine steps (an error past it), whatever the traffic.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tandem.config_resolution import resolve_config
from tandem.core.clock import VirtualClock
from tandem.core.engine_core import EngineCore
from tandem.core.request import Request
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.step_shape import StepShape
from tandem.core.worker.virtual_device import EngineTime, VirtualDeviceExecutor
from tandem.schema.config import EngineConfig
from tandem.schema.sampling_params import SamplingParams
from tandem.simulate.constrained import grammar_tokenizer
from tandem.simulate.plugin_events import PluginEvents
from tandem.simulate.report import RequestTimeline, UsageSample
from tandem.simulate.traffic import ClosedLoopClients, TrafficRequest, prompt_token_ids


@dataclass(slots=True)
class StepRecord:
    """One step with tokens, as the scheduler planned it: {request id: tokens}, the
    preempted and finished ids it carried, and its device span on the virtual clock."""

    step_id: int
    start_s: float
    end_s: float
    num_scheduled_tokens: dict[str, int]
    preempted: frozenset[str]
    finished: frozenset[str]


@dataclass(slots=True)
class SimulationResult:
    """What one stack did with one traffic: per-request timelines, usage samples, device
    time (`busy_s` over `duration_s`, the clock when the last request ended), steps,
    preemptions, and the wall seconds the simulation took (`wall_s`)."""

    timelines: list[RequestTimeline]
    usage: list[UsageSample]
    duration_s: float
    busy_s: float
    num_steps: int
    num_preemptions: int
    wall_s: float
    steps: list[StepRecord] = field(default_factory=list)
    #: Per request id: how many `step_fn` calls the engine had made when it was added
    #: (replaying these into a real engine reproduces the simulation's arrivals by step).
    added_after_calls: dict[str, int] = field(default_factory=dict)


def simulation_config(config: EngineConfig) -> EngineConfig:
    """`config` resolved for the virtual device: the scripted model's loader (the cost
    model, not the weights, stands for the real model) and the `simulated` executor; a
    grammar stack gets a tokenizer (`constrained.grammar_tokenizer`)."""
    config = config.model_copy(deep=True)
    config.parallel.executor = "simulated"
    grammar_tokenizer(config)
    return resolve_config(config)


class _Recorder:
    """Stamps timelines from the executor's step callback and the engine's outputs."""

    def __init__(
        self, clock: VirtualClock, keep_steps: bool, sample_every_s: float, output_s: float = 0.0
    ) -> None:
        self.clock = clock
        #: Seconds from a step's end to the client seeing its outputs (`EngineTime.output_s`).
        self.output_s = output_s
        self.timelines: dict[str, RequestTimeline] = {}
        self.steps: list[StepRecord] | None = [] if keep_steps else None
        self.usage: list[UsageSample] = []
        self.sample_every_s = sample_every_s
        self.num_preemptions = 0

    def on_step(self, start: float, end: float, so: SchedulerOutput, shape: StepShape) -> None:
        for new in so.scheduled_new_reqs:
            timeline = self.timelines[new.req_id]
            if timeline.scheduled_s is None:
                timeline.scheduled_s = start
        for rid in so.preempted_req_ids:
            if rid in self.timelines:
                self.timelines[rid].num_preemptions += 1
                self.num_preemptions += 1
        if self.steps is not None:
            self.steps.append(
                StepRecord(
                    so.step_id,
                    start,
                    end,
                    dict(so.num_scheduled_tokens),
                    frozenset(so.preempted_req_ids),
                    frozenset(so.finished_req_ids),
                )
            )

    def on_outputs(self, outputs: Iterable[Any]) -> list[str]:
        """Stamp tokens and finishes at the clock plus `output_s` (when the client sees
        them); return the ids that finished."""
        now, finished = self.clock.now() + self.output_s, []
        for out in outputs:
            timeline = self.timelines[out.request_id]
            timeline.token_times_s.extend([now] * len(out.new_token_ids))
            if out.finish_reason is not None:
                timeline.finish_s, timeline.finish_reason = now, out.finish_reason
                finished.append(out.request_id)
        return finished

    def sample(self, engine: EngineCore, busy: bool) -> None:
        now = self.clock.now()
        if self.usage and now - self.usage[-1].time_s < self.sample_every_s:
            return
        stats = engine.stats()
        self.usage.append(
            UsageSample(
                time_s=now,
                kv_cache_usage=float(stats.get("kv_cache_usage", 0.0)),
                num_running=int(stats.get("num_running_reqs", 0)),
                num_waiting=int(stats.get("num_waiting_reqs", 0)),
                device_busy=busy,
            )
        )


def make_request(
    traffic: TrafficRequest, index: int, vocab_size: int, eos_token_id: int | None, seed: int
) -> Request:
    """The engine request for one traffic entry: greedy, exactly `output_tokens` tokens
    (EOS ignored), arriving at `traffic.arrival_s` on the virtual clock. With a
    `json_schema` it is constrained by it and stops at EOS (at most `output_tokens`)."""
    schema = traffic.json_schema
    return Request(
        request_id=f"sim-{index}",
        prompt_token_ids=prompt_token_ids(traffic, index, vocab_size, seed),
        sampling_params=SamplingParams(
            temperature=0.0,
            max_tokens=traffic.output_tokens,
            ignore_eos=schema is None,
            structured_outputs=None if schema is None else {"json": schema},
        ),
        eos_token_id=eos_token_id,
        arrival_time=traffic.arrival_s,
        priority=traffic.priority,
    )


def simulate(
    config: EngineConfig,
    traffic: list[TrafficRequest] | ClosedLoopClients,
    *,
    engine_time: EngineTime | None = None,
    tokens: str = "oracle",
    acceptance_rate: float = 0.0,
    parallel: tuple[int, int] = (1, 1),
    overlap: bool = True,
    keep_steps: bool = False,
    sample_every_s: float = 0.1,
    max_steps: int = 50_000_000,
    progress: Callable[[int], None] | None = None,
    seed: int = 0,
    denoise_tokens_per_step: int | None = None,
) -> SimulationResult:
    """Run `traffic` through the stack of `config` on the virtual device; see the module
    docstring. `progress(n)` is called with the number of requests finished since its last
    call. Closed-loop clients send a client's next request when its previous one ends.
    `tokens` and `acceptance_rate`: see `VirtualDeviceExecutor`; `parallel` = (tensor,
    pipeline) parallel sizes the cost model prices each step with (the simulated engine
    itself is one rank: parallelism is a cost, not a process layout); `overlap=False`
    models a device that is the engine's own thread (`VirtualDeviceExecutor.overlap`);
    `denoise_tokens_per_step`: a diffusion stack's denoising model (`DiffusionTokenOracle`;
    None: every canvas takes `diffusion.max_denoising_steps`)."""
    config = simulation_config(config)
    clock = VirtualClock()
    executor = VirtualDeviceExecutor(
        config,
        clock,
        engine_time,
        tokens,
        acceptance_rate,
        seed,
        parallel,
        overlap,
        denoise_tokens_per_step=denoise_tokens_per_step,
    )
    engine = EngineCore(config, executor=executor, clock=clock, source="tandem simulate")
    output_s = engine_time.output_s if engine_time is not None else 0.0
    recorder = _Recorder(clock, keep_steps, sample_every_s, output_s)
    events = PluginEvents(engine)
    has_grammar = bool(engine.plugin_manager.plugins_with_role("grammar"))
    executor.on_step = recorder.on_step
    closed = traffic if isinstance(traffic, ClosedLoopClients) else None
    owner: dict[str, int] = {}
    pending: deque[tuple[int | None, TrafficRequest]] = deque(
        closed.initial() if closed is not None else [(None, t) for t in traffic]
    )
    vocab, eos = config.model.vocab_size or 0, config.model.eos_token_id
    wall_start, index, calls = time.perf_counter(), 0, 0
    added_after_calls: dict[str, int] = {}
    try:
        for _ in range(max_steps):
            now = clock.now()
            while pending and pending[0][1].arrival_s <= now:
                client, entry = pending.popleft()
                if entry.json_schema is not None and not has_grammar:
                    raise ValueError(
                        "traffic: a request has a JSON schema (json=) but the stack has no "
                        "grammar plugin; add structured-output (e.g. grammar-async.yaml)"
                    )
                request = make_request(entry, index, vocab, eos, seed)
                recorder.timelines[request.request_id] = RequestTimeline(
                    request.request_id, entry.arrival_s, entry.prompt_tokens
                )
                if client is not None:
                    owner[request.request_id] = client
                engine.add_request(request)
                added_after_calls[request.request_id] = calls
                index += 1
                if entry.json_schema is not None:
                    executor.mark()  # its compile's wall time is the compile queue's, on the clock
            if not engine.has_work():
                if not pending:
                    break
                clock.advance_to(pending[0][1].arrival_s)
                executor.mark()
                continue
            executor.collected_tokens = None
            outputs, executed = engine.step_fn()
            calls += 1
            if engine.dead_error is not None:
                raise RuntimeError(f"tandem simulate: {engine.dead_error}")
            finished = recorder.on_outputs(outputs)
            if closed is not None:
                for rid in finished:
                    client = owner.pop(rid)
                    nxt = closed.on_finish(client, clock.now() + output_s)
                    if nxt is not None:
                        _insert_sorted(pending, (client, nxt))
            if progress is not None and finished:
                progress(len(finished))
            recorder.sample(engine, busy=clock.now() < executor.device_free_at or executed)
            # idle when the engine would wait for work: it collected a step without tokens
            # and no step with tokens is in flight (only empty steps may be queued)
            in_flight = any(so.total_num_scheduled_tokens for _, so, _ in engine.batch_queue)
            if not executed and executor.collected_tokens == 0 and not in_flight:
                idle_until = events.idle_until(clock.now())  # not past the next arrival
                transfer_end = executor.next_transfer_end_s  # nor a KV transfer's end
                if executor.take_news():  # loads just reported over: admit them now
                    idle_until = clock.now()
                elif transfer_end is not None:
                    idle_until = min(idle_until, transfer_end)
                if pending:
                    idle_until = min(idle_until, pending[0][1].arrival_s)
                clock.advance_to(max(clock.now(), idle_until))  # one already passed: stay
            executor.mark()
        else:
            raise RuntimeError(f"tandem simulate: not done after max_steps={max_steps} steps")
    finally:
        engine.shutdown()
    timelines = list(recorder.timelines.values())
    ends = [t.finish_s for t in timelines if t.finish_s is not None]
    return SimulationResult(
        timelines=timelines,
        usage=recorder.usage,
        duration_s=max(ends, default=clock.now()),
        busy_s=executor.busy_s,
        num_steps=executor.num_steps,
        num_preemptions=recorder.num_preemptions,
        wall_s=time.perf_counter() - wall_start,
        steps=recorder.steps or [],
        added_after_calls=added_after_calls,
    )


def _insert_sorted(
    pending: deque[tuple[int | None, TrafficRequest]], item: tuple[int | None, TrafficRequest]
) -> None:
    """Insert keeping `pending` ordered by arrival (closed-loop arrivals come late)."""
    i = len(pending)
    while i > 0 and pending[i - 1][1].arrival_s > item[1].arrival_s:
        i -= 1
    pending.insert(i, item)
