"""Per-plugin hook timing: how long each plugin's implementation of each hook takes.

`HookTimer.install(manager)` wraps every registered hook implementation of a plugin
manager (pluggy keeps the callable in `HookImpl.function`), so each call is timed on its
own, not the hook as a whole. Totals accumulate per `"plugin.hook"`; with a `StepTracer`
attached, every call is also a span on the `hooks` lane (`tandem trace`). Turned on by the
top-level config flag `trace_hooks` (off: nothing is wrapped, nothing is paid). The kernel
installs it on the engine's manager and, when the worker lives in the engine's process
(in-process and thread executors), on the worker's (`sample`, `propose_drafts`); a worker
in another process is not timed.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pluggy

from tandem.core.step_trace import Span, StepTracer


class HookTimer:
    def __init__(self) -> None:
        self.total_s: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.tracer: StepTracer | None = None
        self.step_id = -1  # set by the kernel; tags spans

    def install(self, manager: pluggy.PluginManager) -> HookTimer:
        for hook_name in manager.hook.__dict__:
            caller = getattr(manager.hook, hook_name)
            if not isinstance(caller, pluggy.HookCaller):
                continue
            for impl in caller.get_hookimpls():
                impl.function = self._wrap(impl.function, f"{impl.plugin_name}.{hook_name}")
        return self

    def _wrap(self, function: Callable[..., Any], key: str) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self.total_s[key] += end - start
                self.calls[key] += 1
                if self.tracer is not None:
                    self.tracer.add(Span("hooks", key, start, end, self.step_id))

        return timed

    def summary(self, num_steps: int) -> dict[str, dict[str, float]]:
        """Per `"plugin.hook"`: calls, total ms and ms per engine step."""
        steps = max(num_steps, 1)
        return {
            key: {
                "calls": self.calls[key],
                "total_ms": 1000 * total,
                "ms_per_step": 1000 * total / steps,
            }
            for key, total in sorted(self.total_s.items(), key=lambda kv: -kv[1])
        }
