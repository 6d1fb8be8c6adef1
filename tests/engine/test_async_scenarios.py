"""Async scheduling with speculative drafts: the scenarios of the async-scheduling spec
(reference/000, "占位符" and "边界条件与已知限制"), one test each, on the scripted model.

The `scripted-drafter` plugin proposes `K = 3` drafts per request of which the first
`num_correct` are right (per request via `num_correct_by_request`), so every verify step's
acceptance is known in advance. A `Recorder` plugin on the engine's plugin manager snapshots
every request's ledger right after each `update_after_schedule` (placeholders added) and
right before and after each `update_from_output`, so each test proves that its scenario
actually happened, not only that the outputs are right:

1. Preemption with 4 tokens in flight (1 sampled + 3 drafts): R is preempted while the step
   holding its 4 placeholders is in flight; its ledger is zeroed with
   `num_stale_output_tokens == 4`; the late result is dropped as stale; R resumes exactly.
2. Rejected drafts roll back `num_computed_tokens` (and, under async, the placeholders that
   covered them); the spec metrics count the accepted and the rejected drafts.
3. The no-extra-step rule with drafts: a request is never scheduled once the outputs it is
   sure to have reach `max_tokens`; a result that overshoots `max_tokens` is cut.
4. A stop token at an accepted draft position trims the rest of the result and still
   resolves every placeholder of that step.
5. An abort arriving while the engine collects a step that verifies drafts of the aborted
   request: the result is skipped, other requests are exact, no KV block leaks.
6. Sync and async give identical outputs on a mixed drafting workload, and every verify
   step accepts exactly the drafts the drafter got right (the drafts are fresh).

Every engine checks the ledger and KV invariants after each step (`check_invariants`), so a
placeholder or stale-count underflow anywhere fails the test. Scenarios 2-4 also run sync.
Two further tests pin bugs these scenarios found (fixed): the worker must start a verify
step at its real history although the scheduler planned it before the in-flight step's
rejections were known, and under async the scheduler must only ever schedule `-1` draft
placeholders (the worker keeps the real drafts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import torch

from tandem.core import hookimpl
from tandem.core.engine_core import EngineCore
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.outputs import EngineCoreOutput
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.executors import InProcessExecutor
from tandem.plugins.reference_scheduler import ReferenceScheduler
from tandem.schema.config import EngineConfig
from tandem.testing.engine import expected_scripted_output, make_request, scripted_config
from tandem.testing.scripted_drafter import ScriptedDrafter
from tandem.testing.stubs import CollectFuture

VOCAB = 128
EOS = 1
K = 3  # drafts per verify step

SYNC_AND_ASYNC = [
    pytest.param(False, id="sync"),
    pytest.param(True, id="async"),
]


# Engines --------------------------------------------------------------------------------------


def drafting_config(
    async_scheduling: bool,
    num_correct: int | None = None,
    num_correct_by_request: dict[str, int] | None = None,
    **overrides: Any,
) -> EngineConfig:
    """Scripted model, K drafts per step from `scripted-drafter`, invariants checked."""
    options: dict[str, Any] = {"num_correct_by_request": dict(num_correct_by_request or {})}
    if num_correct is not None:
        options["num_correct"] = num_correct
    return scripted_config(
        async_scheduling=async_scheduling,
        vocab_size=VOCAB,
        eos_token_id=EOS,
        speculative={"method": "scripted", "num_speculative_tokens": K},
        plugins=[
            {"name": "reference-scheduler"},
            {"name": "default-sampler"},
            {"name": "scripted-drafter", "options": options},
        ],
        **overrides,
    )


class CollectingExecutor(InProcessExecutor):
    """In-process worker; `on_collect[step_id]` runs when the engine collects that step's
    sample future (`result()`), as an abort arriving from another thread while it waits."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.on_collect: dict[int, Callable[[], None]] = {}
        self._unsampled: deque[int] = deque()

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        self._unsampled.append(scheduler_output.step_id)
        return super().execute_model(scheduler_output)

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        step_id = self._unsampled.popleft()
        inner = super().sample_tokens(grammar_bitmask)

        def collect() -> None:  # looked up at collection: the test may set it meanwhile
            action = self.on_collect.pop(step_id, None)
            if action is not None:
                action()

        return CollectFuture(inner, collect)


def make_engine(async_scheduling: bool, **kwargs: Any) -> tuple[EngineCore, Recorder]:
    config = drafting_config(async_scheduling, **kwargs)
    engine = EngineCore(config, executor=CollectingExecutor(config))
    return engine, Recorder.attach(engine)


def scheduler_of(engine: EngineCore) -> ReferenceScheduler:
    return cast(ReferenceScheduler, engine.plugin_manager.plugins_with_role("scheduler")[0])


def drafter_of(engine: EngineCore) -> ScriptedDrafter:
    executor = cast(CollectingExecutor, engine.executor)
    return cast(ScriptedDrafter, executor.worker.plugin_manager.plugins_with_role("drafter")[0])


def expected(prompt: list[int], max_model_len: int, **params: Any) -> tuple[list[int], str]:
    sampling = make_request("x", prompt, **params).sampling_params
    return expected_scripted_output(prompt, sampling, VOCAB, EOS, max_model_len)


# Recording the ledger ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ledger:
    """One request's counters at one moment."""

    status: RequestStatus
    num_tokens: int
    num_computed_tokens: int
    num_output_placeholders: int
    num_in_flight_tokens: int
    num_stale_output_tokens: int

    @classmethod
    def of(cls, request: Request) -> Ledger:
        return cls(
            status=request.status,
            num_tokens=request.num_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_output_placeholders=request.num_output_placeholders,
            num_in_flight_tokens=request.num_in_flight_tokens,
            num_stale_output_tokens=request.num_stale_output_tokens,
        )


@dataclass
class Event:
    """`scheduled`: after `update_after_schedule`; `before`/`after`: around
    `update_from_output` (`sampled` is what the worker returned for the step)."""

    kind: str
    step_id: int
    ledgers: dict[str, Ledger]
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    new_reqs: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)
    sampled: dict[str, list[int]] = field(default_factory=dict)


class _BeforeUpdate:
    """Runs first in `update_from_output` (a plugin holds one implementation per hook)."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    @hookimpl(tryfirst=True)
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        self.recorder.record("before", scheduler_output, model_runner_output)


class Recorder:
    """Snapshots of every request's ledger around each scheduling and each update."""

    def __init__(self, scheduler: ReferenceScheduler) -> None:
        self.scheduler = scheduler
        self.events: list[Event] = []

    @classmethod
    def attach(cls, engine: EngineCore) -> Recorder:
        recorder = cls(scheduler_of(engine))
        engine.plugin_manager.register(recorder, name="test-recorder")
        engine.plugin_manager.register(_BeforeUpdate(recorder), name="test-recorder-before")
        return recorder

    def _ledgers(self) -> dict[str, Ledger]:
        return {rid: Ledger.of(r) for rid, r in self.scheduler.requests.items()}

    def record(self, kind: str, so: SchedulerOutput, mro: ModelRunnerOutput) -> None:
        sampled = {rid: list(mro.sampled_token_ids[i]) for rid, i in mro.req_id_to_index.items()}
        self.events.append(Event(kind, so.step_id, self._ledgers(), sampled=sampled))

    @hookimpl(trylast=True)
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        so = scheduler_output
        self.events.append(
            Event(
                "scheduled",
                so.step_id,
                self._ledgers(),
                num_scheduled_tokens=dict(so.num_scheduled_tokens),
                spec_tokens={rid: list(t) for rid, t in so.scheduled_spec_decode_tokens.items()},
                preempted=set(so.preempted_req_ids),
                new_reqs=[n.req_id for n in so.scheduled_new_reqs],
                running=[r.request_id for r in self.scheduler.running],
            )
        )

    @hookimpl(trylast=True)
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        self.record("after", scheduler_output, model_runner_output)

    def event(self, kind: str, step_id: int) -> Event:
        return next(e for e in self.events if e.kind == kind and e.step_id == step_id)

    def updates(self) -> list[tuple[Event, Event]]:
        """(before, after) of every processed step, in processing order."""
        before = [e for e in self.events if e.kind == "before"]
        after = [e for e in self.events if e.kind == "after"]
        assert [e.step_id for e in before] == [e.step_id for e in after]
        return list(zip(before, after, strict=True))

    def in_flight_at_scheduling(self, step_id: int) -> list[Event]:
        """The `scheduled` events of the steps still unprocessed when `step_id` was planned."""
        index = self.events.index(self.event("scheduled", step_id))
        seen = self.events[:index]
        processed = {e.step_id for e in seen if e.kind == "after"}
        return [e for e in seen if e.kind == "scheduled" and e.step_id not in processed]


class Outputs:
    """Per-request outputs in arrival order; fails on any output after a finish."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[EngineCoreOutput]] = {}

    def step(self, engine: EngineCore) -> list[EngineCoreOutput]:
        step_outputs, _ = engine.step_fn()
        for out in step_outputs:
            previous = self.by_request.setdefault(out.request_id, [])
            assert not previous or previous[-1].finish_reason is None, f"after finish: {out}"
            previous.append(out)
        return step_outputs

    def drain(self, engine: EngineCore, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not engine.has_work():
                return
            self.step(engine)
        raise AssertionError("engine did not become idle")

    def result(self, rid: str) -> tuple[list[int], str | None]:
        outs = self.by_request[rid]
        return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason


def prompt_of(seed: int, length: int) -> list[int]:
    """A deterministic prompt of token ids in [2, 122)."""
    return [2 + (seed * 31 + 17 * i + i * i) % 120 for i in range(length)]


# 1. Preemption with four tokens in flight ------------------------------------------------------


def test_preempted_request_with_four_tokens_in_flight() -> None:
    """The spec's worked example: R is scheduled at step t with 1 sampled + 3 draft tokens
    (4 placeholders); at step t+1's scheduling the KV pool is full and R is preempted:
    `num_computed_tokens = 0`, `num_output_placeholders = 0`, `num_stale_output_tokens = 4`.
    Step t's result then arrives and is dropped as stale (the stale count drains to 0, no
    placeholder is resolved twice); R resumes from WAITING and ends exactly.

    Pool: 8 blocks of 4 = max_model_len 32. A (10-token prompt, every draft right) grows 4
    tokens per step; R (8-token prompt) holds 3 blocks after step t. To make step t's four
    placeholders R's only ones (as in the spec), step 2 is planned with a budget of 4, which
    A's verify step takes whole, so R sits out step 2 and its prefill result is processed
    before step t = 3 is planned.
    """
    max_model_len = 32
    engine, recorder = make_engine(
        True,
        num_correct_by_request={"A": 3, "R": 1},
        max_model_len=max_model_len,
        block_size=4,
        num_kv_blocks=8,
        enable_prefix_caching=False,
        max_num_batched_tokens=64,
    )
    sched = scheduler_of(engine)
    kv = sched.kv_cache_manager
    a_prompt, r_prompt = prompt_of(1, 10), prompt_of(2, 8)
    r = make_request("R", r_prompt, max_tokens=12, ignore_eos=True)
    engine.add_request(make_request("A", a_prompt, max_tokens=30, ignore_eos=True))
    engine.add_request(r)
    outputs = Outputs()

    outputs.step(engine)  # step 1 (both prefills) queued
    sched.max_num_batched_tokens = 4
    outputs.step(engine)  # step 2 = A's verify only; step 1 processed
    sched.max_num_batched_tokens = 64
    assert recorder.event("scheduled", 2).num_scheduled_tokens == {"A": 4}
    outputs.step(engine)  # step t = 3 queued; step 2 processed

    t = recorder.event("scheduled", 3)
    assert t.num_scheduled_tokens["R"] == 1 + K and len(t.spec_tokens["R"]) == K
    assert r.num_output_placeholders == 4 and r.num_in_flight_tokens == 4  # between steps
    assert t.ledgers["R"] == Ledger(
        status=RequestStatus.RUNNING,
        num_tokens=len(r_prompt) + 1,
        num_computed_tokens=len(r_prompt) + 1 + K,
        num_output_placeholders=4,
        num_in_flight_tokens=4,
        num_stale_output_tokens=0,
    )
    # Step 2 (A only) is processed; step 3 is the only step in flight.
    assert [so.step_id for _, so, _ in engine.batch_queue] == [3]
    assert kv.num_free_blocks == 0 and kv.num_fenced_blocks == 0

    step_outputs = outputs.step(engine)  # step t+1 = 4 planned (R preempted); step 3 processed
    t1 = recorder.event("scheduled", 4)
    assert t1.preempted == {"R"} and "R" not in t1.num_scheduled_tokens
    assert t1.ledgers["R"] == Ledger(
        status=RequestStatus.PREEMPTED,
        num_tokens=len(r_prompt) + 1,
        num_computed_tokens=0,
        num_output_placeholders=0,
        num_in_flight_tokens=0,
        num_stale_output_tokens=4,
    )
    # Step 3's result came back with R's tokens and was dropped as stale.
    before, after = recorder.event("before", 3), recorder.event("after", 3)
    assert before.ledgers["R"].num_stale_output_tokens == 4
    assert len(before.sampled["R"]) == 2  # R's accepted draft and the correction, dropped
    assert after.ledgers["R"] == Ledger(
        status=RequestStatus.PREEMPTED,
        num_tokens=len(r_prompt) + 1,
        num_computed_tokens=0,
        num_output_placeholders=0,
        num_in_flight_tokens=0,
        num_stale_output_tokens=0,
    )
    assert not [o for o in step_outputs if o.request_id == "R"]
    assert Ledger.of(r) == after.ledgers["R"]  # and so it stays between steps
    # Counted verify steps: A's in steps 2 and 3; R's stale verify in step 3 is not.
    assert sched.spec_metrics.num_steps == 2

    outputs.drain(engine)
    assert r.num_preemptions == 1
    resumed = [e for e in recorder.events if e.kind == "scheduled" and "R" in e.new_reqs]
    assert [e.step_id for e in resumed][0] == 1 and len(resumed) == 2
    assert outputs.result("R") == expected(r_prompt, max_model_len, max_tokens=12, ignore_eos=True)
    assert outputs.result("A") == expected(a_prompt, max_model_len, max_tokens=30, ignore_eos=True)
    assert kv.all_blocks_free() and kv.num_free_blocks == kv.num_blocks


# 2. Rejected drafts roll back ------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", SYNC_AND_ASYNC)
def test_rejected_drafts_roll_back_computed_tokens_and_placeholders(
    async_scheduling: bool,
) -> None:
    """With 1 of 3 drafts right, every verify step returns 2 tokens (the accepted draft and
    the target's correction) and rejects 2 drafts: processing it lowers num_computed_tokens
    by exactly those 2 and, under async, the placeholders by 2 returned + 2 rejected (all 4
    the step reserved). The spec metrics count 3 drafts and 1 accepted per verify step."""
    max_model_len = 64
    engine, recorder = make_engine(async_scheduling, num_correct=1, max_model_len=max_model_len)
    sched = scheduler_of(engine)
    prompt = prompt_of(3, 5)
    engine.add_request(make_request("R", prompt, max_tokens=14, ignore_eos=True))
    outputs = Outputs()
    outputs.drain(engine)

    counted = [
        (before, after)
        for before, after in recorder.updates()
        if "R" in recorder.event("scheduled", before.step_id).spec_tokens and "R" in before.ledgers
    ]
    verifies = [(before, after) for before, after in counted if "R" in after.ledgers]
    assert len(verifies) >= 4
    for before, after in verifies:
        drafts = recorder.event("scheduled", before.step_id).spec_tokens["R"]
        generated = before.sampled["R"]
        assert len(drafts) == K and len(generated) == 2, (drafts, generated)
        rejected = K - (len(generated) - 1)
        b, a = before.ledgers["R"], after.ledgers["R"]
        assert a.num_tokens - b.num_tokens == 2
        assert b.num_computed_tokens - a.num_computed_tokens == rejected == 2
        assert b.num_in_flight_tokens - a.num_in_flight_tokens == 1 + K
        if async_scheduling:
            assert b.num_output_placeholders - a.num_output_placeholders == 2 + rejected
        else:
            assert b.num_output_placeholders == a.num_output_placeholders == 0
            # Sync: the rollback leaves exactly the last sampled token uncomputed.
            assert a.num_computed_tokens == a.num_tokens - 1
    metrics = sched.spec_metrics
    assert metrics.num_steps == len(counted)
    assert metrics.num_draft_tokens == K * metrics.num_steps
    assert metrics.num_accepted_tokens == metrics.num_steps
    assert metrics.accepted_per_position == [metrics.num_steps, 0, 0]
    assert metrics.mean_acceptance_length == 2.0
    assert outputs.result("R") == expected(prompt, max_model_len, max_tokens=14, ignore_eos=True)


# 3. max_tokens with drafts ----------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", SYNC_AND_ASYNC)
def test_request_is_not_scheduled_past_max_tokens_with_drafts(async_scheduling: bool) -> None:
    """Requests with 0..3 right drafts and max_tokens 2..9 get exactly max_tokens tokens.
    A step is planned for a request only while the outputs it is sure to have (confirmed
    ones plus one per step in flight that samples it: drafts may all be rejected) are below
    max_tokens; under async that rule does skip requests whose in-flight step surely ends
    them. Some results overshoot max_tokens (accepted drafts past it) and are cut."""
    max_model_len = 64
    workload = {
        f"c{c}m{m}": (c, m, prompt_of(10 * c + m, 3 + (c + m) % 5))
        for c in range(K + 1)
        for m in (2, 3, 5, 9)
    }
    engine, recorder = make_engine(
        async_scheduling,
        num_correct_by_request={rid: c for rid, (c, _, _) in workload.items()},
        max_model_len=max_model_len,
    )
    for rid, (_, m, prompt) in workload.items():
        engine.add_request(make_request(rid, prompt, max_tokens=m, ignore_eos=True))
    outputs = Outputs()
    outputs.drain(engine)

    skipped: set[str] = set()
    cut: set[str] = set()
    for rid, (_, m, prompt) in workload.items():
        tokens, reason = outputs.result(rid)
        assert (tokens, reason) == expected(prompt, max_model_len, max_tokens=m, ignore_eos=True)
        assert len(tokens) == m and reason == "length"
        for event in recorder.events:
            if event.kind != "scheduled" or rid not in event.ledgers:
                continue
            confirmed = event.ledgers[rid].num_tokens - len(prompt)
            in_flight = sum(
                rid in e.num_scheduled_tokens
                for e in recorder.in_flight_at_scheduling(event.step_id)
            )
            sure = confirmed + in_flight
            if rid in event.num_scheduled_tokens:
                assert sure < m, (rid, event.step_id, confirmed, in_flight)
            elif rid in event.running and sure >= m:
                skipped.add(rid)
        for before, _ in recorder.updates():
            if rid in before.ledgers and before.ledgers[rid].num_stale_output_tokens == 0:
                remaining = m - (before.ledgers[rid].num_tokens - len(prompt))
                if rid in before.sampled and len(before.sampled[rid]) > remaining > 0:
                    cut.add(rid)
    assert cut, "no result overshot max_tokens"
    if async_scheduling:
        assert skipped, "the no-extra-step rule never fired"
    else:
        assert not skipped


# 4. A stop inside a multi-token result -----------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", SYNC_AND_ASYNC)
def test_stop_token_at_an_accepted_draft_trims_and_resolves_placeholders(
    async_scheduling: bool,
) -> None:
    """Every draft is right, so a verify step returns 4 tokens. The stop token is the 2nd
    token of the second verify step (an accepted draft): the output ends there, the two
    tokens after it (computed and returned by the worker) are never emitted, and the step's
    placeholders are all resolved, the trimmed ones included. Under async the request keeps
    only the placeholders of the step still in flight when it finished; that step's result
    is skipped and nothing else is emitted."""
    max_model_len = 64
    prompt = prompt_of(4, 6)
    free_run, _ = expected(prompt, max_model_len, max_tokens=20, ignore_eos=True)
    # Results: [e0] from the prefill, then [e1..e4], [e5..e8]: stop at e6.
    stop = free_run[6]
    assert stop not in free_run[:6]
    engine, recorder = make_engine(async_scheduling, max_model_len=max_model_len)
    kv = scheduler_of(engine).kv_cache_manager
    r = make_request("R", prompt, max_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    engine.add_request(r)
    outputs = Outputs()
    while "R" not in outputs.by_request or outputs.by_request["R"][-1].finish_reason is None:
        outputs.step(engine)

    assert outputs.result("R") == (free_run[:7], "stop")
    assert outputs.result("R") == expected(
        prompt, max_model_len, max_tokens=20, ignore_eos=True, stop_token_ids=[stop]
    )
    assert outputs.by_request["R"][-1].new_token_ids == free_run[5:7]
    assert r.stop_reason == stop and r.status == RequestStatus.FINISHED_STOPPED
    before, after = recorder.updates()[-1]
    assert before.sampled["R"] == free_run[5:9]  # two tokens past the stop were returned
    assert len(recorder.event("scheduled", before.step_id).spec_tokens["R"]) == K
    assert "R" not in after.ledgers  # released
    # All 4 placeholders of the finishing step are resolved; only in-flight steps' remain.
    in_flight = [
        e
        for _, so, _ in engine.batch_queue
        for e in [recorder.event("scheduled", so.step_id)]
        if "R" in e.num_scheduled_tokens
    ]
    assert r.num_output_placeholders == sum(1 + len(e.spec_tokens.get("R", [])) for e in in_flight)
    assert r.num_in_flight_tokens == sum(e.num_scheduled_tokens["R"] for e in in_flight)
    assert before.ledgers["R"].num_output_placeholders - r.num_output_placeholders == (
        1 + K if async_scheduling else 0
    )
    assert bool(in_flight) == async_scheduling
    assert r.num_computed_tokens >= r.num_output_placeholders
    outputs.drain(engine)  # in-flight steps are collected: nothing more for R
    assert outputs.result("R") == (free_run[:7], "stop")
    assert kv.all_blocks_free()


# 5. Abort while the step is in flight ------------------------------------------------------------


def test_abort_while_verify_step_is_in_flight() -> None:
    """R is aborted (as from another thread) while the engine waits on a step that verifies
    R's drafts; the next step, already planned, holds R too. The abort is drained before the
    update: both results for R are skipped although the worker returned tokens for it, R
    ends with "abort" and what it had, Q and S (other acceptance rates) are exact, and every
    KV block is back in the pool at the end."""
    max_model_len = 64
    engine, recorder = make_engine(
        True,
        num_correct_by_request={"R": 2, "Q": 1, "S": 0},
        max_model_len=max_model_len,
        block_size=4,
        num_kv_blocks=48,
    )
    executor = cast(CollectingExecutor, engine.executor)
    kv = scheduler_of(engine).kv_cache_manager
    prompts = {"R": prompt_of(5, 7), "Q": prompt_of(6, 4), "S": prompt_of(7, 11)}
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, max_tokens=24, ignore_eos=True))
    outputs = Outputs()
    while len(outputs.by_request.get("R", [])) < 3:
        outputs.step(engine)
    in_flight = engine.batch_queue[0][1].step_id
    assert len(recorder.event("scheduled", in_flight).spec_tokens["R"]) == K
    r_tokens_before, _ = outputs.result("R")
    executor.on_collect[in_flight] = lambda: engine.abort_requests(["R"])

    step_outputs = outputs.step(engine)  # plans the next step (with R), collects in_flight
    next_step = recorder.event("scheduled", in_flight + 1)
    assert "R" in next_step.num_scheduled_tokens
    before = recorder.event("before", in_flight)
    assert "R" not in before.ledgers and len(before.sampled["R"]) == 1 + 2
    assert [(o.new_token_ids, o.finish_reason) for o in step_outputs if o.request_id == "R"] == [
        ([], "abort")
    ]
    assert {o.request_id for o in step_outputs} == {"R", "Q", "S"}
    outputs.drain(engine)
    assert "R" in recorder.event("before", in_flight + 1).sampled  # computed, then skipped

    r_full, _ = expected(prompts["R"], max_model_len, max_tokens=24, ignore_eos=True)
    assert outputs.result("R") == (r_tokens_before, "abort")
    assert r_tokens_before == r_full[: len(r_tokens_before)]
    for rid in ("Q", "S"):
        assert outputs.result(rid) == expected(
            prompts[rid], max_model_len, max_tokens=24, ignore_eos=True
        )
    assert kv.all_blocks_free() and kv.num_free_blocks == kv.num_blocks


# 6. Sync and async agree -------------------------------------------------------------------------


def _mixed_workload() -> dict[str, tuple[int, list[int], dict[str, Any]]]:
    """8 requests: prompts of 2..29 tokens, max_tokens 5..26, 0..3 right drafts each."""
    workload = {}
    for i in range(8):
        params: dict[str, Any] = {"max_tokens": 5 + (i * 7) % 22, "ignore_eos": i % 3 != 0}
        workload[f"w{i}"] = (i % (K + 1), prompt_of(20 + i, 2 + (i * 9) % 28), params)
    return workload


def _run_mixed(async_scheduling: bool) -> tuple[dict[str, Any], EngineCore, Recorder]:
    workload = _mixed_workload()
    engine, recorder = make_engine(
        async_scheduling,
        num_correct_by_request={rid: c for rid, (c, _, _) in workload.items()},
        max_model_len=64,
        block_size=4,
        num_kv_blocks=24,  # 96 slots for up to 6 requests of up to 64 tokens: preemption
        max_num_batched_tokens=24,
        max_num_seqs=6,
    )
    for rid, (_, prompt, params) in workload.items():
        engine.add_request(make_request(rid, prompt, **params))
    outputs = Outputs()
    outputs.drain(engine)
    assert scheduler_of(engine).kv_cache_manager.all_blocks_free()
    return {rid: outputs.result(rid) for rid in workload}, engine, recorder


def test_drafts_under_async_match_sync() -> None:
    """A mixed drafting workload (chunked prefills, preemptions, acceptance 0..3 of 3)
    gives the same tokens sync and async, equal to the scripted reference. Both runs use the
    drafter, and every verify step whose result is applied accepts exactly min(right drafts,
    drafts scheduled): under async the worker verifies the drafts proposed after the
    previous step, not older ones."""
    workload = _mixed_workload()
    runs = {mode: _run_mixed(mode) for mode in (False, True)}
    for rid, (_, prompt, params) in workload.items():
        assert runs[False][0][rid] == expected(prompt, 64, **params), rid
    assert runs[True][0] == runs[False][0]

    for async_scheduling, (_, engine, recorder) in runs.items():
        drafter = drafter_of(engine)
        assert any(drafts for _, drafts in drafter.proposals)
        metrics = scheduler_of(engine).spec_metrics
        assert metrics.num_accepted_tokens > 0
        assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
        num_verified = 0
        for before, _ in recorder.updates():
            spec = recorder.event("scheduled", before.step_id).spec_tokens
            for rid, drafts in spec.items():
                ledger = before.ledgers.get(rid)
                if ledger is None or ledger.num_stale_output_tokens > 0:
                    continue  # finished or preempted meanwhile: the result is skipped
                accepted = len(before.sampled[rid]) - 1
                assert accepted == min(workload[rid][0], len(drafts)), (
                    async_scheduling,
                    before.step_id,
                    rid,
                )
                num_verified += 1
        assert num_verified == metrics.num_steps
        chunked = any(
            e.num_scheduled_tokens.get(rid, 0) < len(prompt)
            for rid, (_, prompt, _) in workload.items()
            for e in recorder.events
            if e.kind == "scheduled" and rid in e.new_reqs
        )
        assert chunked
        assert scheduler_of(engine).num_preemptions > 0


# The bugs these scenarios found, pinned --------------------------------------------------------------------------


def test_async_verify_step_after_rejected_drafts() -> None:
    """The smallest case of the first bug: one request, 1 of 3 drafts right, async. The second
    verify step is planned while the first is in flight, so the scheduler's
    num_computed_tokens counts the first step's 2 rejected drafts; the worker must start the
    step after its real history (as vLLM's runner corrects the in-flight rejections)."""
    engine, _ = make_engine(True, num_correct=1, max_model_len=64)
    prompt = prompt_of(8, 5)
    engine.add_request(make_request("R", prompt, max_tokens=10, ignore_eos=True))
    outputs = Outputs()
    outputs.drain(engine)
    assert outputs.result("R") == expected(prompt, 64, max_tokens=10, ignore_eos=True)


def test_async_schedules_only_draft_placeholders() -> None:
    """Under async the scheduler never sees real drafts: every scheduled draft is `-1`."""
    engine, recorder = make_engine(True, max_model_len=64)
    engine.add_request(make_request("R", prompt_of(9, 5), max_tokens=16, ignore_eos=True))
    Outputs().drain(engine)
    scheduled = [
        drafts
        for e in recorder.events
        if e.kind == "scheduled"
        for drafts in e.spec_tokens.values()
    ]
    assert len(scheduled) >= 3
    assert all(d == [-1] * len(d) for d in scheduled), scheduled
