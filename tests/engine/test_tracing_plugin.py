"""The `hook-tracing` plugin: wrapper hooks and boundary marks time each plugin apart,
keep call order, and patch nothing inside pluggy.

The slow plugins advance a fake clock that the tracer reads instead of sleeping, so the
per-plugin times are exact and hold on a busy machine (no wall-clock bound is asserted)."""

from __future__ import annotations

from collections.abc import Generator
from types import SimpleNamespace
from typing import Any

import pluggy
import pytest

from tandem.core import hookimpl
from tandem.core.plugin_manager import PluginConfigError
from tandem.plugins import tracing as tracing_module
from tandem.plugins.tracing import StepTracer, enable_tracing, tracing_of
from tandem.testing import collect_outputs, make_request, make_scripted_engine

SLOW_S = 0.004


class FakeClock:
    """Seconds that pass only when a test plugin `sleep`s."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def now(self) -> float:
        return self.seconds

    def sleep(self, seconds: float) -> None:
        self.seconds += seconds


CLOCK = FakeClock()


@pytest.fixture(autouse=True)
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    monkeypatch.setattr(tracing_module, "time", SimpleNamespace(perf_counter=CLOCK.now))
    return CLOCK


class SlowFirst:
    """Runs before every other `update_after_schedule` (tryfirst) and takes SLOW_S."""

    @hookimpl(tryfirst=True)
    def update_after_schedule(self) -> None:
        CLOCK.sleep(SLOW_S)


class SlowLast:
    """Runs after every other `update_after_schedule` (trylast) and takes 2 * SLOW_S."""

    @hookimpl(trylast=True)
    def update_after_schedule(self) -> None:
        CLOCK.sleep(2 * SLOW_S)


class Observer:
    """A third-party wrapper: must stay outside the per-plugin times."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl(wrapper=True)
    def update_after_schedule(self) -> Generator[None, Any, Any]:
        self.calls += 1
        result = yield
        CLOCK.sleep(SLOW_S)
        return result


def call_order(manager: pluggy.PluginManager, hook: str) -> list[str]:
    impls = getattr(manager.hook, hook).get_hookimpls()
    return [i.plugin_name for i in reversed(impls) if not i.plugin_name.startswith("hook-tracing")]


def run(engine: Any) -> None:
    for i in range(3):
        engine.add_request(make_request(str(i), [3 + i, 4, 5], max_tokens=4, ignore_eos=True))
    outputs = collect_outputs(engine)
    assert all(len(tokens) == 4 for tokens, _ in outputs.values())


def test_each_plugin_is_timed_apart_whatever_its_place() -> None:
    engine = make_scripted_engine(async_scheduling=True)
    manager = engine.plugin_manager
    observer = Observer()
    for name, plugin in (("slow-first", SlowFirst()), ("slow-last", SlowLast())):
        manager.register(plugin, name)
    manager.register(observer, "observer")
    order = call_order(manager, "update_after_schedule")
    tracing = enable_tracing(engine, StepTracer())
    assert call_order(manager, "update_after_schedule") == order  # nothing reordered
    run(engine)
    summary = tracing.summary(engine.num_steps)
    calls = summary["reference-scheduler.update_after_schedule"]["calls"]
    assert calls == observer.calls > 0
    for key, seconds in (("slow-first", SLOW_S), ("slow-last", 2 * SLOW_S)):
        entry = summary[f"{key}.update_after_schedule"]
        assert entry["calls"] == calls
        per_call = entry["total_ms"] / 1000 / calls
        assert per_call == pytest.approx(seconds)  # its own sleep, not a neighbour's
    # The fast plugins' times hold none of the sleeps around them (the observer's included).
    for key in ("reference-scheduler", "async-scheduler"):
        assert summary[f"{key}.update_after_schedule"]["total_ms"] == 0


def test_implementations_are_untouched_and_marks_sit_before_each() -> None:
    engine = make_scripted_engine(async_scheduling=True, trace_hooks=True)
    caller = engine.plugin_manager.hook.update_after_schedule
    impls = list(reversed(caller.get_hookimpls()))  # call order
    real = [i for i in impls if not i.plugin_name.startswith("hook-tracing")]
    for impl in real:  # the plugin's own bound method, not a wrapper around it
        assert impl.function == impl.plugin.update_after_schedule
        before = impls[impls.index(impl) - 1]
        assert before.plugin_name == f"hook-tracing:after:{impl.plugin_name}"
    wrappers = [i for i in impls if i.wrapper]
    assert [w.plugin_name for w in wrappers] == ["hook-tracing"]
    assert tracing_of(engine) is enable_tracing(engine)  # one per engine


def test_engine_lane_has_one_schedule_span_per_step_and_the_waits() -> None:
    engine = make_scripted_engine(async_scheduling=False, trace_hooks=True)
    tracer = StepTracer()
    enable_tracing(engine, tracer)
    run(engine)
    engine_spans = [s for s in tracer.spans if s.lane == "engine"]
    names = [s.name for s in engine_spans]
    # sync: schedule (schedule + update_after_schedule), wait, update, once per step
    assert names == ["schedule", "wait", "update"] * engine.num_steps
    assert [s.step_id for s in engine_spans[::3]] == list(range(engine.num_steps))
    hook_spans = [s for s in tracer.spans if s.lane == "hooks"]
    schedule_span = engine_spans[0]
    inside = [s for s in hook_spans if s.step_id == 0 and s.name.endswith("update_after_schedule")]
    assert inside and all(
        schedule_span.start <= s.start <= s.end <= schedule_span.end for s in inside
    )


def test_naming_it_in_a_stack_points_at_the_flag() -> None:
    with pytest.raises(PluginConfigError, match="hook-tracing.*trace_hooks: true"):
        make_scripted_engine(plugins=["reference-scheduler", "default-sampler", "hook-tracing"])
