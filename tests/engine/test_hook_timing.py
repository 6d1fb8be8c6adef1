"""Per-plugin hook timing (`trace_hooks`, the `hook-tracing` plugin): every implementation is
timed on its own."""

from __future__ import annotations

import pluggy

from tandem.plugins.tracing import StepTracer, tracing_of
from tandem.testing import collect_outputs, make_request, make_scripted_engine


def run(trace_hooks: bool, tracer: StepTracer | None = None):  # noqa: ANN201
    engine = make_scripted_engine(async_scheduling=True, trace_hooks=trace_hooks)
    if tracer is not None:
        tracing_of(engine).tracer = tracer
    for i in range(3):
        engine.add_request(make_request(str(i), [3 + i, 4, 5], max_tokens=5, ignore_eos=True))
    outputs = collect_outputs(engine)
    assert all(len(tokens) == 5 for tokens, _ in outputs.values())
    return engine


def test_each_plugin_hook_pair_is_counted() -> None:
    engine = run(trace_hooks=True)
    summary = tracing_of(engine).summary(engine.num_steps)
    schedule_calls = summary["reference-scheduler.schedule"]["calls"]
    assert schedule_calls >= engine.num_steps > 0
    # The scheduler and the async layer both implement update_after_schedule: timed apart,
    # once per schedule call each.
    assert summary["reference-scheduler.update_after_schedule"]["calls"] == schedule_calls
    assert summary["async-scheduler.update_after_schedule"]["calls"] == schedule_calls
    assert summary["reference-scheduler.update_from_output"]["calls"] == engine.num_steps
    # Worker-side hooks too (the worker runs in process here).
    assert summary["default-sampler.sample"]["calls"] > 0
    assert all(v["total_ms"] >= 0 and v["ms_per_step"] >= 0 for v in summary.values())


def test_hook_calls_become_spans_on_the_hooks_lane() -> None:
    tracer = StepTracer()
    engine = run(trace_hooks=True, tracer=tracer)
    hook_spans = [s for s in tracer.spans if s.lane == "hooks"]
    names = {s.name for s in hook_spans}
    assert {"reference-scheduler.schedule", "async-scheduler.update_after_schedule"} <= names
    assert all(s.start <= s.end for s in hook_spans)
    assert max(s.step_id for s in hook_spans) == engine.num_steps - 1
    chrome = tracer.to_chrome_trace("engine")
    assert any(e.get("name") == "reference-scheduler.schedule" for e in chrome)


def test_off_by_default_and_nothing_wrapped() -> None:
    engine = run(trace_hooks=False)
    assert tracing_of(engine) is None
    caller = engine.plugin_manager.hook.schedule
    assert isinstance(caller, pluggy.HookCaller)
    assert not any(hasattr(i.function, "__wrapped__") for i in caller.get_hookimpls())
