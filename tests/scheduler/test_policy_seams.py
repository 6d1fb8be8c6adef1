"""The policy seams stacked on the reference scheduler: a WAITING order
(`make_waiting_queue`), a preemption victim (`select_preemption_victim`) and readiness
(`requests_not_ready`, `wait_for_work`), each a small plugin, all in one stack. Order and
victims change observably; tokens never do (scripted model, sync and async). A RUNNING
request that is not ready while its placeholders are in flight keeps its KV blocks and
resumes exactly."""

from __future__ import annotations

import zlib
from collections.abc import Generator, Sequence
from typing import Any

import pytest

from tandem.core import hookimpl
from tandem.core.engine_core import IDLE_WAIT_S, EngineCore
from tandem.core.plugin_manager import PluginConfigError, TandemPlugin
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.waiting_queue import WaitingQueue
from tandem.plugins.request_queue import KeyedQueue
from tandem.schema.config import EngineConfig
from tandem.testing import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    make_scripted_engine,
)

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
VOCAB, EOS, MAX_MODEL_LEN = 128, 1, 128


# The policy plugins ----------------------------------------------------------------------
class ShortestPromptQueue(KeyedQueue):
    """WAITING by prompt length, then arrival (a `WaitingQueue`; put-back keeps the key)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_steps = 0

    def key(self, request: Request) -> tuple:
        return (request.num_prompt_tokens, request.arrival_time)

    def advance(self, now: float) -> None:
        self.num_steps += 1


class ShortestPromptFirst(TandemPlugin):
    """Ordering seam: admits the shortest prompt first."""

    def __init__(self, config: EngineConfig, options: Any) -> None:
        super().__init__(config, options)
        self.queue: ShortestPromptQueue | None = None

    @hookimpl
    def make_waiting_queue(self, config: EngineConfig) -> WaitingQueue:
        self.queue = ShortestPromptQueue()
        return self.queue


class LargestHolderVictim(TandemPlugin):
    """Victim seam: preempts the running request holding the most KV (the most computed
    tokens; ties: the newest); records each choice next to FCFS's (`running[-1]`)."""

    def __init__(self, config: EngineConfig, options: Any) -> None:
        super().__init__(config, options)
        self.choices: list[tuple[str, str]] = []

    @hookimpl
    def select_preemption_victim(self, running: Sequence[Request], needed_by: Request) -> Request:
        victim = max(reversed(running), key=lambda r: r.num_computed_tokens)
        self.choices.append((victim.request_id, running[-1].request_id))
        return victim


def _phase(request_id: str) -> int:
    return zlib.crc32(request_id.encode()) % 5


class Pauser(TandemPlugin):
    """Readiness seam: at every fifth `schedule` call of its own phase a request is not
    ready (WAITING or RUNNING alike); `held` are not ready until released. Records which
    RUNNING requests it paused and the kernel's `wait_for_work` calls."""

    def __init__(self, config: EngineConfig, options: Any) -> None:
        super().__init__(config, options)
        self.periodic = True
        self.held: set[str] = set()
        self.calls = 0
        self.known: dict[str, Request] = {}
        self.paused_running: set[str] = set()
        self.paused_waiting: set[str] = set()
        self.idle_waits: list[float] = []

    @hookimpl
    def add_request(self, request: Request) -> None:
        self.known[request.request_id] = request

    @hookimpl
    def requests_not_ready(self) -> set[str]:
        self.calls += 1
        ids = set(self.held)
        if self.periodic:
            ids |= {rid for rid in self.known if (_phase(rid) + self.calls) % 5 == 0}
        for rid in ids:
            request = self.known.get(rid)
            if request is not None and request.status == RequestStatus.RUNNING:
                self.paused_running.add(rid)
            elif request is not None and not request.is_finished:
                self.paused_waiting.add(rid)
        return ids

    @hookimpl
    def wait_for_work(self, timeout_s: float) -> None:
        self.idle_waits.append(timeout_s)


class StepRecorder:
    """Registered after the stack: the requests each step scheduled, admitted and
    preempted (a wrapper around whichever plugin answers `schedule`)."""

    def __init__(self) -> None:
        self.scheduled: list[set[str]] = []
        self.admitted: list[str] = []
        self.preempted: list[str] = []

    @hookimpl(wrapper=True)
    def schedule(self) -> Generator[None, SchedulerOutput, SchedulerOutput]:
        output = yield
        self.scheduled.append(set(output.num_scheduled_tokens))
        self.admitted += [r.req_id for r in output.scheduled_new_reqs]
        self.preempted += sorted(output.preempted_req_ids)
        return output


SEAMS = (ShortestPromptFirst, LargestHolderVictim, Pauser)


def seams_stack(*plugins: type) -> list[Any]:
    """The seams registered by class (no packaging), stacked with the reference scheduler."""
    return ["reference-scheduler", *(plugins or SEAMS), "default-sampler"]


def plugin(engine: EngineCore, cls: type) -> Any:
    (instance,) = [p for _, p in engine.plugin_manager.stack if isinstance(p, cls)]
    return instance


def prompt(request_id: str, length: int) -> list[int]:
    seed = zlib.crc32(request_id.encode())
    return [2 + (seed + 37 * i + i * i) % (VOCAB - 2) for i in range(length)]


def workload() -> list[Request]:
    """Long prompts first, short ones last (so shortest-first reorders), enough of them for
    a small pool to preempt."""
    sizes = [(40, 12), (33, 20), (25, 8), (18, 30), (12, 16), (7, 24), (4, 10), (2, 18)]
    return [
        make_request(f"r{i}", prompt(f"r{i}", n), max_tokens=m, ignore_eos=True)
        for i, (n, m) in enumerate(sizes)
    ]


def expected(request: Request) -> tuple[list[int], str]:
    return expected_scripted_output(
        request.prompt_token_ids, request.sampling_params, VOCAB, EOS, MAX_MODEL_LEN
    )


def run(engine: EngineCore) -> tuple[StepRecorder, dict[str, tuple[list[int], str | None]]]:
    recorder = StepRecorder()
    engine.plugin_manager.register(recorder)
    requests = workload()
    for request in requests:
        engine.add_request(request)
    return recorder, collect_outputs(engine)


LIMITS: dict[str, Any] = {
    "max_model_len": MAX_MODEL_LEN,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 4,
    "num_kv_blocks": 32,  # 128 slots: the running requests outgrow it
    "enable_prefix_caching": False,
    "check_invariants": True,
}


# The seams together ------------------------------------------------------------------------
@MODES
def test_order_victim_and_readiness_plugins_in_one_stack(async_scheduling: bool) -> None:
    engine = make_scripted_engine(
        plugins=seams_stack(), async_scheduling=async_scheduling, **LIMITS
    )
    plain = make_scripted_engine(async_scheduling=async_scheduling, **LIMITS)
    try:
        seams, outputs = run(engine)
        reference, plain_outputs = run(plain)
        # Tokens: exact, and equal to the plain reference engine's.
        assert outputs == plain_outputs
        assert all(outputs[r.request_id] == expected(r) for r in workload())
        # Order: the plugin's queue is the scheduler's, and it reorders admission.
        order = plugin(engine, ShortestPromptFirst)
        assert engine.plugin_manager.plugins_with_role("scheduler")[0].waiting is order.queue
        assert order.queue.num_steps == len(seams.scheduled)  # `advance` once per schedule
        assert seams.admitted[0] == "r7" and reference.admitted[0] == "r0"
        # Victims: chosen by the plugin, at least once not the one FCFS would take.
        victim = plugin(engine, LargestHolderVictim)
        assert seams.preempted and sorted(v for v, _ in victim.choices) == sorted(seams.preempted)
        assert any(v != fcfs for v, fcfs in victim.choices)
        # Readiness: paused requests were never scheduled in the steps that paused them.
        pauser = plugin(engine, Pauser)
        assert pauser.paused_running and pauser.paused_waiting
        for call, scheduled in enumerate(seams.scheduled, 1):
            paused = {rid for rid in pauser.known if (_phase(rid) + call) % 5 == 0}
            assert not scheduled & paused, (call, scheduled & paused)
    finally:
        engine.shutdown()
        plain.shutdown()


def test_running_request_not_ready_with_placeholders_in_flight_keeps_its_kv() -> None:
    """Async: R is held while the step it was just scheduled in is still in flight (its
    placeholders unresolved). It is skipped, stays RUNNING with the same blocks, the step in
    flight resolves its placeholders, and once released it resumes exactly."""
    engine = make_scripted_engine(plugins=seams_stack(Pauser), async_scheduling=True, **LIMITS)
    try:
        pauser = plugin(engine, Pauser)
        pauser.periodic = False
        recorder = StepRecorder()
        engine.plugin_manager.register(recorder)
        r = make_request("R", prompt("R", 9), max_tokens=24, ignore_eos=True)
        s = make_request("S", prompt("S", 5), max_tokens=40, ignore_eos=True)
        engine.add_request(r)
        engine.add_request(s)
        tokens: dict[str, list[int]] = {"R": [], "S": []}

        def step() -> None:
            outputs, _ = engine.step_fn()
            for out in outputs:
                tokens[out.request_id] += out.new_token_ids

        while r.num_output_tokens < 4 or r.num_output_placeholders == 0:
            step()  # R decoding, a step of it in flight
        assert r.num_output_placeholders > 0 and engine.batch_queue
        pauser.held.add("R")
        blocks = list(engine.scheduler_state.kv_cache_manager.get_block_ids("R"))
        computed = r.num_computed_tokens
        outputs_before = r.num_output_tokens
        paused_steps = len(recorder.scheduled)
        for _ in range(6):
            step()
            assert r.status == RequestStatus.RUNNING
            assert engine.scheduler_state.kv_cache_manager.get_block_ids("R") == blocks
        held = recorder.scheduled[paused_steps:]
        assert held and all("R" not in ids and "S" in ids for ids in held)
        # The step in flight came back: its placeholder resolved into a token.
        assert r.num_output_placeholders == 0
        assert r.num_output_tokens == outputs_before + 1
        assert r.num_computed_tokens == computed
        pauser.held.clear()
        while engine.has_work():
            step()
        for request in (r, s):
            assert tokens[request.request_id] == expected(request)[0]
        assert r.num_preemptions == 0
    finally:
        engine.shutdown()


@MODES
def test_idle_engine_asks_plugins_to_wait_instead_of_spinning(async_scheduling: bool) -> None:
    """Every request left is not ready: each step schedules nothing and the kernel calls
    `wait_for_work` (never while a step with tokens is in flight)."""
    engine = make_scripted_engine(
        plugins=seams_stack(Pauser), async_scheduling=async_scheduling, **LIMITS
    )
    try:
        pauser = plugin(engine, Pauser)
        pauser.periodic = False
        recorder = StepRecorder()
        engine.plugin_manager.register(recorder)
        request = make_request("x", [5, 6, 7], max_tokens=3, ignore_eos=True)
        pauser.held.add("x")
        engine.add_request(request)
        for _ in range(6):
            engine.step_fn()
        assert recorder.scheduled and not any(recorder.scheduled)
        assert pauser.idle_waits and set(pauser.idle_waits) == {IDLE_WAIT_S}
        waits = len(pauser.idle_waits)
        pauser.held.clear()
        outputs = collect_outputs(engine)
        assert outputs["x"] == expected(request)
        assert len(pauser.idle_waits) == waits  # busy steps never wait
    finally:
        engine.shutdown()


# Contract errors name the plugin -----------------------------------------------------------
class NotAQueue(TandemPlugin):
    @hookimpl
    def make_waiting_queue(self, config: EngineConfig) -> object:
        return []


class VictimOutsideRunning(TandemPlugin):
    @hookimpl
    def select_preemption_victim(self, running: Sequence[Request], needed_by: Request) -> Request:
        return make_request("stranger", [2, 3])


def test_a_queue_that_breaks_the_protocol_is_an_error_naming_the_plugin() -> None:
    with pytest.raises(PluginConfigError, match=r"make_waiting_queue: plugin '\S+:NotAQueue'"):
        make_scripted_engine(plugins=seams_stack(NotAQueue))


def test_a_victim_outside_running_is_an_error_naming_the_plugin() -> None:
    engine = make_scripted_engine(plugins=seams_stack(VictimOutsideRunning), **LIMITS)
    try:
        for request in workload():
            engine.add_request(request)
        with pytest.raises(
            RuntimeError,
            match=r"select_preemption_victim: plugin '\S+:VictimOutsideRunning' returned "
            r".*stranger.*not one of the RUNNING requests",
        ):
            collect_outputs(engine)
    finally:
        engine.shutdown()
