"""The engine loop under async scheduling: the batch queue, aborts, the no-extra-step rule,
and sync/async parity.

A `TrackingExecutor` runs the worker in process and hands back futures that log when the
engine collects them (`result()`), and may run an action at that moment (an abort arriving
from another thread while the engine waits on the step). An observer plugin registered on
the engine's plugin manager logs the step id of every `update_after_schedule` and
`update_from_output` call.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from tandem.core import hookimpl
from tandem.core.engine_core import EngineCore
from tandem.core.executor import Executor, completed
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.outputs import EngineCoreOutput
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.worker import Worker
from tandem.testing.engine import (
    expected_scripted_output,
    make_request,
    scripted_config,
)
from tandem.testing.stubs import CollectFuture

VOCAB = 128
EOS = 1


class TrackingExecutor(Executor):
    """In-process worker; logs executions and collections, and may act on a collection.

    `events` gets ("execute", step_id, queue length) at each `execute_model` and
    ("collect", step_id) when the engine calls `result()` on a step's sample future.
    `on_collect[step_id]` runs right before that step's result is handed over.
    """

    def __init__(self, config: Any) -> None:
        self.worker = Worker(config)
        self.engine: EngineCore | None = None
        self.events: list[tuple[Any, ...]] = []
        self.on_collect: dict[int, Callable[[], None]] = {}
        self._unsampled: list[int] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        assert self.engine is not None
        self.events.append(("execute", scheduler_output.step_id, len(self.engine.batch_queue)))
        self._unsampled.append(scheduler_output.step_id)
        return completed(self.worker.execute_model, scheduler_output)

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        step_id = self._unsampled.pop(0)
        inner = completed(self.worker.sample_tokens, grammar_bitmask)

        def collect() -> None:
            self.events.append(("collect", step_id))
            action = self.on_collect.get(step_id)
            if action is not None:
                action()

        return CollectFuture(inner, collect)

    def collected(self) -> list[int]:
        return [e[1] for e in self.events if e[0] == "collect"]


class Observer:
    """Logs what the scheduler planned and when each step's results were applied."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.scheduled: list[tuple[int, dict[str, int]]] = []
        self.updated: list[int] = []
        self.live_at_update: list[set[str]] = []

    @hookimpl(trylast=True)
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        self.scheduled.append(
            (scheduler_output.step_id, dict(scheduler_output.num_scheduled_tokens))
        )

    @hookimpl(tryfirst=True)
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        self.updated.append(scheduler_output.step_id)
        self.live_at_update.append(set(self.engine.scheduler_state.requests))
        return None

    def steps_scheduling(self, rid: str) -> list[int]:
        return [step_id for step_id, n in self.scheduled if n.get(rid, 0) > 0]


def make_engine(**overrides: Any) -> tuple[EngineCore, TrackingExecutor, Observer]:
    settings: dict[str, Any] = {"vocab_size": VOCAB, "eos_token_id": EOS, "async_scheduling": True}
    settings.update(overrides)
    config = scripted_config(**settings)
    executor = TrackingExecutor(config)
    engine = EngineCore(config, executor=executor)
    executor.engine = engine
    observer = Observer(engine)
    engine.plugin_manager.register(observer, name="test-observer")
    return engine, executor, observer


def expected(prompt: list[int], max_model_len: int, **params: Any) -> tuple[list[int], str]:
    sampling = make_request("x", prompt, **params).sampling_params
    return expected_scripted_output(prompt, sampling, VOCAB, EOS, max_model_len)


class Outputs:
    """Per-request outputs in arrival order; fails on output after a finish."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[EngineCoreOutput]] = {}

    def add(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            previous = self.by_request.setdefault(out.request_id, [])
            assert not previous or previous[-1].finish_reason is None, f"after finish: {out}"
            previous.append(out)

    def result(self, rid: str) -> tuple[list[int], str | None]:
        outs = self.by_request[rid]
        return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason


def run(engine: EngineCore, outputs: Outputs, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        step_outputs, _ = engine.step_fn()
        outputs.add(step_outputs)
    raise AssertionError("engine did not become idle")


# The batch queue --------------------------------------------------------------------------


def test_batch_queue_returns_without_blocking_and_holds_at_most_two() -> None:
    engine, executor, observer = make_engine(max_model_len=64, block_size=4)
    assert engine.step_fn == engine.step_with_batch_queue
    assert engine.batch_queue_size == 2
    prompts = {"a": [2, 3, 5, 7], "b": [7, 7, 2], "c": [3] * 9}
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, max_tokens=5, ignore_eos=True))
    outputs = Outputs()

    # The first step is queued and the call returns at once: nothing collected or applied.
    step_outputs, model_executed = engine.step_with_batch_queue()
    assert step_outputs == [] and model_executed
    assert len(engine.batch_queue) == 1
    assert executor.collected() == [] and observer.updated == []

    # From then on each call queues one step and collects the oldest: 1 entry remains.
    step_outputs, _ = engine.step_with_batch_queue()
    outputs.add(step_outputs)
    assert executor.collected() == [1] and observer.updated == [1]
    assert len(engine.batch_queue) == 1
    assert engine.batch_queue[0][1].step_id == 2
    assert {o.request_id for o in step_outputs} == set(prompts)

    while engine.has_work():
        before = len(executor.collected())
        step_outputs, _ = engine.step_with_batch_queue()
        outputs.add(step_outputs)
        assert len(executor.collected()) == before + 1  # exactly one step collected a call
        assert len(engine.batch_queue) <= 1
    # A step is only ever queued next to at most one other: at most 2 in flight.
    queue_lengths = [e[2] for e in executor.events if e[0] == "execute"]
    assert max(queue_lengths) == 1
    # Steps are collected and applied exactly in the order they were scheduled.
    scheduled = [step_id for step_id, _ in observer.scheduled]
    assert executor.collected() == scheduled
    assert observer.updated == scheduled == list(range(1, len(scheduled) + 1))
    for rid, prompt in prompts.items():
        assert outputs.result(rid) == expected(prompt, 64, max_tokens=5, ignore_eos=True)
    assert engine.scheduler_state.kv_cache_manager.all_blocks_free()


def test_sync_step_never_uses_the_batch_queue() -> None:
    engine, executor, observer = make_engine(async_scheduling=False, max_model_len=64)
    assert engine.step_fn == engine.step and engine.batch_queue_size == 1
    engine.add_request(make_request("a", [2, 3, 5], max_tokens=4, ignore_eos=True))
    outputs = Outputs()
    while engine.has_work():
        step_outputs, _ = engine.step_fn()
        outputs.add(step_outputs)
        assert not engine.batch_queue
        # Every step is applied in the call that scheduled it.
        assert observer.updated == [s for s, _ in observer.scheduled]
    assert outputs.result("a") == expected([2, 3, 5], 64, max_tokens=4, ignore_eos=True)


# Aborts -----------------------------------------------------------------------------------


def _decode_until_in_flight(engine: EngineCore, outputs: Outputs, rid: str, n: int) -> int:
    """Step until `rid` has `n` tokens; return the step id in flight (it holds `rid`)."""
    while len([t for o in outputs.by_request.get(rid, []) for t in o.new_token_ids]) < n:
        step_outputs, _ = engine.step_fn()
        outputs.add(step_outputs)
    assert len(engine.batch_queue) == 1
    in_flight = engine.batch_queue[0][1]
    assert rid in in_flight.num_scheduled_tokens
    return in_flight.step_id


def test_abort_between_steps_drops_the_in_flight_result() -> None:
    engine, executor, observer = make_engine(max_model_len=64, block_size=4)
    r_prompt, q_prompt = [2, 3, 5, 7, 2], [5, 3, 2]
    engine.add_request(make_request("R", r_prompt, max_tokens=20, ignore_eos=True))
    engine.add_request(make_request("Q", q_prompt, max_tokens=12, ignore_eos=True))
    outputs = Outputs()
    in_flight = _decode_until_in_flight(engine, outputs, "R", 3)

    engine.abort_requests(["R"])
    step_outputs, _ = engine.step_fn()
    outputs.add(step_outputs)
    # The abort was drained before the in-flight step was applied: R's result is dropped.
    r_outs = [o for o in step_outputs if o.request_id == "R"]
    assert [(o.new_token_ids, o.finish_reason) for o in r_outs] == [([], "abort")]
    assert step_outputs[0].request_id == "R"  # reported first, from the drain
    index = observer.updated.index(in_flight)
    assert "R" not in observer.live_at_update[index]
    # R was not scheduled again after the abort.
    assert max(observer.steps_scheduling("R")) == in_flight
    run(engine, outputs)

    r_expected, _ = expected(r_prompt, 64, max_tokens=20, ignore_eos=True)
    assert outputs.result("R") == (r_expected[:3], "abort")
    assert outputs.result("Q") == expected(q_prompt, 64, max_tokens=12, ignore_eos=True)
    assert engine.scheduler_state.kv_cache_manager.all_blocks_free()


def test_abort_arriving_while_the_engine_waits_is_drained_before_the_update() -> None:
    """An abort queued (as from another thread) while the engine waits on a step's result
    is processed before that step's `update_from_output`: the result for the aborted
    request is dropped, it ends with "abort" and gets no token after that."""
    engine, executor, observer = make_engine(max_model_len=64, block_size=4)
    r_prompt, q_prompt = [2, 3, 5, 7, 2], [5, 3, 2]
    engine.add_request(make_request("R", r_prompt, max_tokens=20, ignore_eos=True))
    engine.add_request(make_request("Q", q_prompt, max_tokens=12, ignore_eos=True))
    outputs = Outputs()
    in_flight = _decode_until_in_flight(engine, outputs, "R", 3)
    executor.on_collect[in_flight] = lambda: engine.abort_requests(["R"])

    step_outputs, _ = engine.step_fn()  # schedules the next step (with R), collects in_flight
    outputs.add(step_outputs)
    assert executor.collected()[-1] == in_flight
    assert observer.steps_scheduling("R")[-1] == in_flight + 1  # planned before the abort
    r_outs = [o for o in step_outputs if o.request_id == "R"]
    assert [(o.new_token_ids, o.finish_reason) for o in r_outs] == [([], "abort")]
    index = observer.updated.index(in_flight)
    assert "R" not in observer.live_at_update[index]
    q_outs = [o for o in step_outputs if o.request_id == "Q"]
    assert len(q_outs) == 1 and len(q_outs[0].new_token_ids) == 1  # Q's result applied
    run(engine, outputs)

    r_expected, _ = expected(r_prompt, 64, max_tokens=20, ignore_eos=True)
    assert outputs.result("R") == (r_expected[:3], "abort")
    assert outputs.result("Q") == expected(q_prompt, 64, max_tokens=12, ignore_eos=True)
    assert max(observer.steps_scheduling("R")) == in_flight + 1
    assert engine.scheduler_state.kv_cache_manager.all_blocks_free()


def test_abort_of_a_waiting_request_and_of_a_finished_one() -> None:
    """Aborting a request still waiting gives an empty "abort" output; aborting one that
    has already finished is ignored (no second finish)."""
    engine, _, _ = make_engine(max_model_len=64, max_num_seqs=1)
    engine.add_request(make_request("A", [2, 3], max_tokens=2, ignore_eos=True))
    engine.add_request(make_request("W", [3, 2], max_tokens=2, ignore_eos=True))
    outputs = Outputs()
    outputs.add(engine.step_fn()[0])
    engine.abort_requests(["W"])
    run(engine, outputs)
    assert outputs.result("W") == ([], "abort")
    assert outputs.result("A") == expected([2, 3], 64, max_tokens=2, ignore_eos=True)
    engine.abort_requests(["A", "W", "never-added"])
    run(engine, outputs)
    assert [o.finish_reason for o in outputs.by_request["A"]][-1] == "length"
    assert len(outputs.by_request["W"]) == 1


def test_a_finished_request_id_is_reusable_once_its_steps_are_collected() -> None:
    """Under async a request can finish (here on a stop token) while a step computing it
    is still in flight. Re-adding its id then is refused; once that step is collected the
    id is accepted and the new request gets exactly its own tokens (no stale result of the
    old one)."""
    engine, _, _ = make_engine(max_model_len=64)
    first_prompt, second_prompt = [2, 3, 5, 7, 2], [3, 3, 3]
    first_expected, _ = expected(first_prompt, 64, max_tokens=20, ignore_eos=True)
    stop_token = first_expected[2]
    engine.add_request(
        make_request("R", first_prompt, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_token])
    )
    outputs = Outputs()
    while "R" not in outputs.by_request or outputs.by_request["R"][-1].finish_reason is None:
        outputs.add(engine.step_fn()[0])
    assert outputs.result("R") == (first_expected[: first_expected.index(stop_token) + 1], "stop")
    assert any("R" in so.num_scheduled_tokens for _, so, _ in engine.batch_queue)
    with pytest.raises(ValueError, match="in flight"):
        engine.add_request(make_request("R", second_prompt, max_tokens=4, ignore_eos=True))
    outputs.add(engine.step_fn()[0])  # collects the step still computing the old R
    assert not engine.batch_queue
    engine.add_request(make_request("R", second_prompt, max_tokens=4, ignore_eos=True))
    second = Outputs()
    run(engine, second)
    assert second.result("R") == expected(second_prompt, 64, max_tokens=4, ignore_eos=True)
    assert engine.scheduler_state.kv_cache_manager.all_blocks_free()


# The no-extra-step rule -------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_request_at_max_tokens_gets_no_extra_step(async_scheduling: bool) -> None:
    engine, _, observer = make_engine(
        async_scheduling=async_scheduling, max_model_len=128, max_num_batched_tokens=256
    )
    prompts = {f"m{k}": [2 + k % 5] * (3 + k) for k in range(1, 9)}
    for k, (rid, prompt) in enumerate(prompts.items(), 1):
        engine.add_request(make_request(rid, prompt, max_tokens=k, ignore_eos=True))
    outputs = Outputs()
    run(engine, outputs)
    for k, (rid, prompt) in enumerate(prompts.items(), 1):
        assert outputs.result(rid) == expected(prompt, 128, max_tokens=k, ignore_eos=True)
        # The prompt fits one chunk: one step per output token, none more.
        assert len(observer.steps_scheduling(rid)) == k, rid


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_request_at_max_model_len_gets_no_extra_step(async_scheduling: bool) -> None:
    engine, _, observer = make_engine(
        async_scheduling=async_scheduling, max_model_len=24, max_num_batched_tokens=64
    )
    prompt = [3, 5, 7] * 6  # 18 tokens: 6 outputs reach max_model_len
    engine.add_request(make_request("L", prompt, max_tokens=100, ignore_eos=True))
    outputs = Outputs()
    run(engine, outputs)
    assert outputs.result("L") == expected(prompt, 24, max_tokens=100, ignore_eos=True)
    assert len(outputs.result("L")[0]) == 6
    assert len(observer.steps_scheduling("L")) == 6


# Sync and async parity ---------------------------------------------------------------------


def _parity_workload() -> list[tuple[str, list[int], dict[str, Any]]]:
    requests = []
    for i in range(16):
        length = 3 + (i * 7) % 30  # up to 32 tokens: longer than the budget, chunked
        prompt = [(2, 3, 5, 7)[(i + j) % 4] if j % 3 else 2 + i % 3 for j in range(length)]
        params: dict[str, Any] = {"max_tokens": 6 + (i * 5) % 25, "ignore_eos": i % 3 != 0}
        if i % 5 == 1:
            params["stop_token_ids"] = [17, 42]
        requests.append((f"p{i}", prompt, params))
    return requests


def _run_parity(async_scheduling: bool, temperature: float) -> tuple[dict[str, Any], Any]:
    engine, _, observer = make_engine(
        async_scheduling=async_scheduling,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=24,  # 96 slots for 16 requests of up to 62 tokens: preemption
        max_num_batched_tokens=10,  # prompts of up to 32 tokens: chunked prefill
        max_num_seqs=8,
        enable_prefix_caching=True,
    )
    for i, (rid, prompt, params) in enumerate(_parity_workload()):
        sampling = dict(params, temperature=temperature)
        if temperature > 0:
            sampling["seed"] = 1000 + i
        engine.add_request(make_request(rid, prompt, **sampling))
    outputs = Outputs()
    run(engine, outputs)
    scheduler = engine.plugin_manager.plugins_with_role("scheduler")[0]
    assert engine.scheduler_state.kv_cache_manager.all_blocks_free()
    first_chunk = {}
    for _, scheduled in observer.scheduled:
        for rid, n in scheduled.items():
            first_chunk.setdefault(rid, n)
    chunked = any(first_chunk[rid] < len(prompt) for rid, prompt, _ in _parity_workload())
    stats = {"preemptions": scheduler.num_preemptions, "chunked": chunked}
    return {rid: outputs.result(rid) for rid in outputs.by_request}, stats


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sync_and_async_give_identical_outputs(temperature: float) -> None:
    sync_outputs, sync_stats = _run_parity(False, temperature)
    async_outputs, async_stats = _run_parity(True, temperature)
    assert sync_stats["preemptions"] > 0 and async_stats["preemptions"] > 0
    assert sync_stats["chunked"] and async_stats["chunked"]
    assert len(sync_outputs) == 16
    assert async_outputs == sync_outputs
    if temperature == 0.0:
        for rid, prompt, params in _parity_workload():
            assert sync_outputs[rid] == expected(prompt, 64, **params), rid
    else:
        assert _run_parity(True, temperature)[0] == async_outputs
