"""A plugin author's mistakes surface as errors naming the plugin, the hook and when: a hook
that raises in a step stops the engine with a `PluginError` (plugin, hook, `file:line`,
step) and `LLM.generate` raises instead of reporting success; a hook that raises while the
stack starts is a `PluginStartError`; a hookimpl whose signature its hookspec refuses fails
at resolution (before any engine exists) with its `file:line`; two plugins answering one
exclusive policy seam are refused at resolution, naming both."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.config_resolution import resolve_config
from tandem.core import hookimpl
from tandem.core.engine_core import EngineDeadError
from tandem.core.plugin_error import PluginError
from tandem.core.plugin_manager import PluginConfigError, PluginStartError, TandemPlugin
from tandem.core.request import Request
from tandem.core.waiting_queue import WaitingQueue
from tandem.plugins.request_queue import FCFSQueue
from tandem.schema.config import EngineConfig
from tandem.stack_checks import _spec_manager, signature_errors
from tandem.stack_file import load_config
from tandem.testing import make_request, make_scripted_engine

#: A pool too small for four requests: the scheduler must ask for a victim.
TIGHT = {"num_kv_blocks": 8, "block_size": 4, "max_model_len": 32, "max_num_batched_tokens": 64}


class RaisingVictim(TandemPlugin):
    @hookimpl
    def select_preemption_victim(self, running: Sequence[Request], needed_by: Request) -> Request:
        raise ZeroDivisionError("victim rule divided by zero")


class RaisingQueue(TandemPlugin):
    @hookimpl
    def make_waiting_queue(self, config: EngineConfig) -> WaitingQueue:
        raise ValueError("queue options make no sense")


class RaisingAdd(TandemPlugin):
    @hookimpl
    def add_request(self, request: Request) -> None:
        raise KeyError("per-request table")


class MisnamedArgument(TandemPlugin):
    @hookimpl
    def select_preemption_victim(self, running: Sequence[Request], needed: Request) -> Request:
        return running[-1]


class OrderA(TandemPlugin):
    @hookimpl
    def make_waiting_queue(self, config: EngineConfig) -> WaitingQueue:
        return FCFSQueue()


class OrderB(OrderA):
    @hookimpl
    def make_waiting_queue(self, config: EngineConfig) -> WaitingQueue:
        return FCFSQueue()


class VictimA(TandemPlugin):
    @hookimpl
    def select_preemption_victim(self, running: Sequence[Request], needed_by: Request) -> Request:
        return running[-1]


class VictimB(VictimA):
    @hookimpl
    def select_preemption_victim(self, running: Sequence[Request], needed_by: Request) -> Request:
        return running[0]


def _line_of(function: Any) -> str:
    return f"{inspect.getsourcefile(function)}:{function.__code__.co_firstlineno}"


def _stack(*plugins: Any) -> list[Any]:
    return ["reference-scheduler", *plugins, "default-sampler"]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_raising_victim_hook_stops_the_engine_naming_plugin_hook_and_step(
    async_scheduling: bool,
) -> None:
    engine = make_scripted_engine(
        plugins=_stack(RaisingVictim), async_scheduling=async_scheduling, **TIGHT
    )
    try:
        for i in range(4):
            engine.add_request(make_request(f"r{i}", [2 + i] * 8, max_tokens=20, ignore_eos=True))
        outputs = []
        while engine.has_work():
            step_outputs, _ = engine.run_step()
            outputs += step_outputs
        failure = engine.dead_exception
        assert isinstance(failure, PluginError)
        assert failure.plugin.endswith(":RaisingVictim")
        assert failure.hook == "select_preemption_victim"
        assert failure.where == _line_of(RaisingVictim.select_preemption_victim)
        assert failure.step == engine.num_steps
        assert isinstance(failure.cause, ZeroDivisionError)
        message = engine.dead_error or ""
        assert "RaisingVictim" in message and "select_preemption_victim" in message
        assert f"engine step {failure.step}" in message
        assert {o.finish_reason for o in outputs if o.finished} == {"error"}
        assert all("select_preemption_victim" in (o.error or "") for o in outputs if o.finished)
    finally:
        engine.shutdown()


class RecordingBar:
    """A tqdm-like bar that remembers what it was told."""

    def __init__(self, total: int, **kwargs: Any) -> None:
        self.total, self.n, self.desc, self.postfix, self.closed = total, 0, "", "", False
        BARS.append(self)

    def update(self, n: int) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


BARS: list[RecordingBar] = []


def test_llm_generate_raises_on_an_engine_failure_and_the_bar_is_not_complete() -> None:
    BARS.clear()
    llm = LLM(model="scripted", plugins=_stack(RaisingVictim), **TIGHT)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with pytest.raises(EngineDeadError) as info:
        llm.generate([[2 + i] * 8 for i in range(4)], params, use_tqdm=RecordingBar)
    message = str(info.value)
    assert "RaisingVictim" in message and "select_preemption_victim" in message
    assert "engine step" in message
    assert isinstance(info.value.__cause__, PluginError)
    (bar,) = BARS
    assert bar.closed and bar.n < bar.total and "failed" in bar.desc
    with pytest.raises(EngineDeadError):  # the engine takes no new work
        llm.generate([[2, 3]], params, use_tqdm=False)


def test_a_raising_make_waiting_queue_is_a_start_error_naming_plugin_and_hook() -> None:
    with pytest.raises(PluginStartError) as info:
        make_scripted_engine(plugins=_stack(RaisingQueue))
    failure = info.value
    assert isinstance(failure, PluginConfigError) and isinstance(failure, PluginError)
    assert failure.plugin.endswith(":RaisingQueue") and failure.hook == "make_waiting_queue"
    assert _line_of(RaisingQueue.make_waiting_queue) in str(failure)
    assert "queue options make no sense" in str(failure)


def test_a_raising_add_request_names_the_plugin_and_the_engine_goes_on() -> None:
    engine = make_scripted_engine(plugins=_stack(RaisingAdd))
    try:
        with pytest.raises(PluginError, match=r"RaisingAdd' failed in hook add_request"):
            engine.add_request(make_request("a", [2, 3], max_tokens=2))
        assert engine.dead_error is None and not engine.has_work()
    finally:
        engine.shutdown()


def test_a_misnamed_hook_argument_fails_at_resolution_with_file_and_line() -> None:
    config = load_config(None, model="scripted", plugins=_stack(MisnamedArgument))
    with pytest.raises(PluginConfigError) as info:
        resolve_config(config)
    message = str(info.value)
    assert "plugins[1]" in message and "MisnamedArgument" in message
    assert "select_preemption_victim" in message and "needed" in message
    assert _line_of(MisnamedArgument.select_preemption_victim) in message


def test_a_refused_signature_leaves_the_check_clean_for_the_next_stack() -> None:
    """pluggy < 1.7 keeps the name of a plugin whose registration it refused; the check
    must drop it, or every later stack implementing that hook fails "already registered"."""
    assert signature_errors(MisnamedArgument)
    assert _spec_manager().list_name_plugin() == []
    assert signature_errors(VictimA) == []
    resolve_config(load_config(None, model="scripted", plugins=_stack(VictimA)))


@pytest.mark.parametrize(
    ("first", "second", "seam"),
    [
        (OrderA, OrderB, "make_waiting_queue"),
        (VictimA, VictimB, "select_preemption_victim"),
    ],
    ids=["ordering", "victim"],
)
def test_two_plugins_on_one_exclusive_seam_are_refused_naming_both(
    first: type, second: type, seam: str
) -> None:
    config = load_config(None, model="scripted", plugins=_stack(first, second))
    with pytest.raises(PluginConfigError) as info:
        resolve_config(config)
    message = str(info.value)
    assert f":{first.__name__}'" in message and f":{second.__name__}'" in message
    assert f"both answer {seam}" in message
    assert "plugins[1]" in message and "plugins[2]" in message


def test_one_plugin_per_seam_still_stacks() -> None:
    """An ordering, a victim and the scheduler's own default victim: no conflict."""
    engine = make_scripted_engine(plugins=_stack(OrderA, VictimA))
    engine.shutdown()


class BatchOnlySampler(TandemPlugin):
    """Raises when asked to sample two or more requests together (no single request
    explains that, so the step fails); leaves one request to the default sampler."""

    @hookimpl(tryfirst=True)
    def sample(self, logits: Any, metadata: Any) -> None:
        if logits.shape[0] >= 2:
            raise OverflowError("batched sampling overflowed")


@pytest.mark.parametrize("executor", ["inprocess", "thread", "process"])
def test_a_worker_side_hook_failure_names_the_plugin_in_every_executor(executor: str) -> None:
    """The sampler runs in the worker; under the process executor its frames stay in the
    worker process, which names the implementation before the error crosses the pipe."""
    engine = make_scripted_engine(
        plugins=["reference-scheduler", BatchOnlySampler, "default-sampler"],
        parallel={"executor": executor},
        max_model_len=32,
    )
    try:
        for i in range(2):
            engine.add_request(make_request(f"r{i}", [2 + i] * 4, max_tokens=4, ignore_eos=True))
        while engine.has_work():
            engine.run_step()
        failure = engine.dead_exception
        assert isinstance(failure, PluginError), engine.dead_error
        assert failure.plugin.endswith(":BatchOnlySampler")
        assert failure.hook == "sample"
        assert failure.where == _line_of(BatchOnlySampler.sample)
        assert failure.step == engine.num_steps
        message = engine.dead_error or ""
        assert "BatchOnlySampler" in message and "hook sample" in message
        assert "batched sampling overflowed" in message
    finally:
        engine.shutdown()
