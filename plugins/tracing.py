"""Tracing: the step timeline and per-plugin hook timing, as a plugin on pluggy's wrappers.

Turned on by the top-level config flag `trace_hooks` (the kernel then attaches this plugin,
found like any plugin by its entry-point name `hook-tracing`) or by `enable_tracing(engine)`.
Off, nothing is registered and nothing is paid.

What it records:
- per `"plugin.hook"`: the calls and total time of that plugin's implementation (`summary`);
- with a `StepTracer` set on `tracer`: each such call as a span on the `hooks` lane, and the
  engine's spans on the `engine` lane: `schedule` (the `schedule` and `update_after_schedule`
  calls), `wait` (the kernel waiting for a step's results, reported through
  `EngineCore.wait_observer`, the one span that is not a hook call) and `update`
  (`update_from_output`). Every span carries the engine's step count when it started.
- for a block-diffusion model (a resolved `diffusion` section), two more lanes
  (`DiffusionEvents`): `denoise`, one span per step that denoised canvases, from its
  `schedule` to the end of its `update_from_output`, named `denoise N` (N canvases; args:
  `canvases`, `canvas_positions`, `request_ids`); and `commit`, one span per committed
  canvas, at the `update_from_output` that appended it, named `commit <request id> +K`
  (args: `request_id`, `tokens` (K), `finish_reason`).
- with a KV connector in the stack (`KVTransferSpans`), the `kv` lane: each step's
  `kv load`, `forward` and `kv save` phases as the worker timed them.

How: every implemented hook gets a `wrapper=True, trylast=True` implementation (the wrapper
next to the implementations, so its teardown follows the last one). Wrappers run around all
implementations and never between them, so to time each plugin apart a boundary *mark* (a
plain implementation with no argument and no result) is called right before each
implementation: a mark closes the previous implementation's time and opens the next, the
wrapper's teardown closes the last. Marks get their place from pluggy's own ordering rules:
the managed plugins are registered again in their order, each with its marks beside it, with
the same `tryfirst`/`trylast` flags. Nothing inside pluggy is patched. The engine's manager is
instrumented and, when the worker lives in this process (in-process, thread and simulated
executors), the worker's (`sample`, `propose_drafts`); a worker in another process is not
timed. Times are inclusive: a hook called from inside an implementation counts in both.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import pluggy

from tandem.core import hookimpl
from tandem.core.plugin_manager import PluginConfigError

if TYPE_CHECKING:
    from tandem.core.engine_core import EngineCore
    from tandem.core.outputs import EngineCoreOutput
    from tandem.core.scheduler_output import SchedulerOutput

#: Engine hooks whose calls are also spans on the `engine` lane, by span name.
ENGINE_SPANS = {
    "schedule": "schedule",
    "update_after_schedule": "schedule",
    "update_from_output": "update",
}


@dataclass(slots=True)
class Span:
    lane: str
    name: str
    start: float
    end: float
    step_id: int = -1
    #: Extra Chrome-trace args (besides `step`), e.g. a commit's request id and tokens.
    args: dict[str, Any] | None = None


@dataclass
class StepTracer:
    """Collects spans; `span()` times a block on a lane. Executors that know their device
    time (the simulated device) add spans on a `device` lane."""

    spans: list[Span] = field(default_factory=list)

    @contextmanager
    def span(self, lane: str, name: str, step_id: int = -1) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(lane, name, start, time.perf_counter(), step_id))

    def add(self, span: Span) -> None:
        self.spans.append(span)

    def to_chrome_trace(
        self, process: str, pid: int = 0, origin: float | None = None
    ) -> list[dict]:
        """Chrome trace events (chrome://tracing, Perfetto) in microseconds from `origin`
        (the first span by default); one thread per lane."""
        if not self.spans:
            return []
        t0 = origin if origin is not None else min(s.start for s in self.spans)
        lanes = sorted({s.lane for s in self.spans})
        events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}}
        ]
        for tid, lane in enumerate(lanes):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}}
            )
        for s in self.spans:
            events.append(
                {
                    "name": s.name,
                    "ph": "X",
                    "pid": pid,
                    "tid": lanes.index(s.lane),
                    "ts": (s.start - t0) * 1e6,
                    "dur": (s.end - s.start) * 1e6,
                    "args": {"step": s.step_id, **(s.args or {})},
                }
            )
        return events


class _Frame:
    """One hook call in progress: the implementation running now and since when."""

    __slots__ = ("key", "start")

    def __init__(self) -> None:
        self.key: str | None = None
        self.start = 0.0


class _Holder:
    """Carries generated hook implementations (marks or wrappers) as instance attributes
    named after their hooks."""


class HookTracing:
    """The tracing plugin (see the module docstring). One per engine: `attach` returns the
    one already registered. It is no stack entry: a stack naming `hook-tracing` fails to
    load, pointing at `trace_hooks: true` (its hooks are generated per engine at attach)."""

    attached_by: ClassVar[str | None] = "trace_hooks"

    name: ClassVar[str] = "hook-tracing"

    def __init__(self, engine: EngineCore, tracer: StepTracer | None = None) -> None:
        self.engine = engine
        #: Where spans go; None: only the per-plugin totals are kept.
        self.tracer = tracer
        self.total_s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        #: The engine's step count when the current schedule, wait or update began.
        self.step_id = -1
        self._open_schedule: Span | None = None
        self._local = threading.local()  # the hook calls in progress on each thread

    @classmethod
    def attach(cls, engine: EngineCore, tracer: StepTracer | None = None) -> HookTracing:
        found = tracing_of(engine)
        if found is not None:
            found.tracer = tracer if tracer is not None else found.tracer
            return found
        tracing = cls(engine, tracer)
        tracing._instrument(engine.plugin_manager, engine_side=True)
        worker = getattr(engine.executor, "worker", None)  # a worker in this process
        if worker is not None:
            tracing._instrument(worker.plugin_manager, engine_side=False)
        engine.wait_observer = tracing._wait
        if getattr(engine.config, "diffusion", None) is not None:
            engine.plugin_manager.register(DiffusionEvents(tracing), f"{cls.name}:diffusion")
        if engine.plugin_manager.hook.start_load_kv.get_hookimpls():
            engine.plugin_manager.register(KVTransferSpans(tracing), f"{cls.name}:kv")
        return tracing

    @hookimpl
    def tandem_stack_loaded(self) -> None:
        """Reached only when a stack names this plugin (`attach` registers generated hooks,
        never this method)."""
        raise PluginConfigError(
            f"plugins: {self.name!r} is not a stack entry; turn tracing on with the top-level "
            "flag `trace_hooks: true`"
        )

    def summary(self, num_steps: int) -> dict[str, dict[str, float]]:
        """Per `"plugin.hook"`, slowest first: calls, total ms and ms per engine step."""
        steps = max(num_steps, 1)
        return {
            key: {
                "calls": self.calls[key],
                "total_ms": 1000 * total,
                "ms_per_step": 1000 * total / steps,
            }
            for key, total in sorted(self.total_s.items(), key=lambda kv: -kv[1])
        }

    # Instrumenting a manager ------------------------------------------------------------
    def _instrument(self, manager: pluggy.PluginManager, engine_side: bool) -> None:
        """Register a wrapper per implemented hook under this plugin's name (on the engine
        side, with `tracing` pointing here), and each plugin again with a mark before each
        of its implementations."""
        wrappers = _Holder()
        marks: dict[str, tuple[_Holder, _Holder]] = {}  # plugin -> (before it, after it)
        for hook_name, caller in vars(manager.hook).items():
            if not isinstance(caller, pluggy.HookCaller):
                continue
            impls = [i for i in caller.get_hookimpls() if not (i.wrapper or i.hookwrapper)]
            for impl in impls:
                pre, post = marks.setdefault(impl.plugin_name, (_Holder(), _Holder()))
                mark = self._mark(f"{impl.plugin_name}.{hook_name}")
                # pluggy inserts a trylast implementation below those registered before it
                # and any other above them: registered on that side, the mark runs just before.
                opts = hookimpl(tryfirst=impl.tryfirst, trylast=impl.trylast)
                setattr(pre if impl.trylast else post, hook_name, opts(mark))
            if impls:
                span = ENGINE_SPANS.get(hook_name) if engine_side else None
                wrapper = self._wrapper(hook_name, span)
                setattr(wrappers, hook_name, hookimpl(wrapper=True, trylast=True)(wrapper))
        plugins = [(n, p) for n, p in manager.list_name_plugin() if p is not None]
        for _, plugin in plugins:
            manager.unregister(plugin)
        for name, plugin in plugins:
            pre, post = marks.get(name, (_Holder(), _Holder()))
            if vars(pre):
                manager.register(pre, f"{self.name}:before:{name}")
            manager.register(plugin, name)
            if vars(post):
                manager.register(post, f"{self.name}:after:{name}")
        if engine_side:
            wrappers.tracing = self  # type: ignore[attr-defined]
        manager.register(wrappers, self.name)

    def _mark(self, key: str) -> Callable[[], None]:
        def mark() -> None:
            frame = self._local.stack[-1]
            now = time.perf_counter()
            if frame.key is not None:
                self._record(frame.key, frame.start, now)
            frame.key, frame.start = key, now

        return mark

    def _wrapper(self, hook_name: str, span: str | None) -> Callable[[], Generator[None, Any, Any]]:
        def wrapper() -> Generator[None, Any, Any]:
            stack = self._local.__dict__.setdefault("stack", [])
            frame = _Frame()
            stack.append(frame)
            if span is not None and hook_name != "update_after_schedule":
                self.step_id = self.engine.num_steps
            start = time.perf_counter()
            try:
                return (yield)
            finally:
                end = time.perf_counter()
                stack.pop()
                if frame.key is not None:
                    self._record(frame.key, frame.start, end)
                if span is not None:
                    self._engine_span(hook_name, span, start, end)

        return wrapper

    # Recording ------------------------------------------------------------------------
    def _record(self, key: str, start: float, end: float) -> None:
        self.total_s[key] += end - start
        self.calls[key] += 1
        if self.tracer is not None:
            self.tracer.add(Span("hooks", key, start, end, self.step_id))

    def _engine_span(self, hook_name: str, name: str, start: float, end: float) -> None:
        if self.tracer is None:
            return
        if hook_name == "update_after_schedule" and self._open_schedule is not None:
            self._open_schedule.end = end  # one `schedule` span: schedule + its update
            self._open_schedule = None
            return
        span = Span("engine", name, start, end, self.step_id)
        self._open_schedule = span if hook_name == "schedule" else None
        self.tracer.add(span)

    @contextmanager
    def _wait(self) -> Iterator[None]:
        self.step_id = self.engine.num_steps
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.tracer is not None:
                self.tracer.add(Span("engine", "wait", start, time.perf_counter(), self.step_id))


class DiffusionEvents:
    """Denoising steps and commits on the `denoise` and `commit` lanes (module docstring);
    registered beside `HookTracing` on the engine of a block-diffusion model."""

    def __init__(self, tracing: HookTracing) -> None:
        self.tracing = tracing
        self._scheduled: dict[int, tuple[float, int]] = {}  # id(output) -> (start, step)

    @hookimpl(wrapper=True)
    def schedule(self) -> Generator[None, SchedulerOutput, SchedulerOutput]:
        start = time.perf_counter()
        output = yield
        if output.scheduled_spec_decode_tokens:
            self._scheduled[id(output)] = (start, self.tracing.engine.num_steps)
        return output

    @hookimpl(wrapper=True)
    def update_from_output(
        self, scheduler_output: SchedulerOutput
    ) -> Generator[None, list[list[EngineCoreOutput]], list[list[EngineCoreOutput]]]:
        results = yield  # one list of outputs per implementation
        tracer = self.tracing.tracer
        scheduled = self._scheduled.pop(id(scheduler_output), None)
        if tracer is None or scheduled is None:
            return results
        start, step = scheduled
        end = time.perf_counter()
        canvases = scheduler_output.scheduled_spec_decode_tokens
        args = {
            "canvases": len(canvases),
            "canvas_positions": sum(len(c) for c in canvases.values()),
            "request_ids": sorted(canvases),
        }
        tracer.add(Span("denoise", f"denoise {len(canvases)}", start, end, step, args))
        for out in (o for outputs in results for o in outputs or ()):
            if out.new_token_ids:
                commit = {
                    "request_id": out.request_id,
                    "tokens": len(out.new_token_ids),
                    "finish_reason": out.finish_reason,
                }
                name = f"commit {out.request_id} +{len(out.new_token_ids)}"
                tracer.add(Span("commit", name, end, end, step, commit))
        return results


class KVTransferSpans:
    """A KV connector's phases on the `kv` lane: per step, `kv load`, `forward` and
    `kv save` as the worker timed them (`KVConnectorOutput.spans`, one monotonic clock
    for every process of a host); registered beside `HookTracing` when the stack has a
    connector."""

    def __init__(self, tracing: HookTracing) -> None:
        self.tracing = tracing

    @hookimpl(tryfirst=True)
    def update_from_output(self, model_runner_output: Any) -> None:
        output = getattr(model_runner_output, "kv_connector_output", None)
        tracer = self.tracing.tracer
        if output is None or tracer is None:
            return
        for name, start, end in output.spans:
            tracer.add(Span("kv", name, start, end, self.tracing.engine.num_steps))


def tracing_of(engine: EngineCore) -> HookTracing | None:
    """The tracing plugin registered on `engine`, or None when tracing is off."""
    return getattr(engine.plugin_manager.get_plugin(HookTracing.name), "tracing", None)


def enable_tracing(engine: EngineCore, tracer: StepTracer | None = None) -> HookTracing:
    """Turn tracing on for `engine` (as `trace_hooks: true` does at start); with `tracer`,
    spans are recorded into it. Returns the engine's tracing plugin."""
    return HookTracing.attach(engine, tracer)
