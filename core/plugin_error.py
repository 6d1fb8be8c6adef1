"""`PluginError`: a plugin's hook implementation raised; the error names the plugin, the
hook, where the implementation is defined and when (which engine step) it failed.

The kernel does not wrap hook calls (a try per call would cost on the hot path). Where it
catches a failure (the step loop, `add_request`, the stack's start) it asks
`failing_hook(exc, sites)` which implementation raised: the innermost frame of the
traceback (following `__cause__` / `__context__`) whose code is a known hook
implementation. A policy seam that the scheduler calls from inside its own `schedule`
(`select_preemption_victim`) is therefore named, not the scheduler around it. `sites` comes
from `TandemPluginManager.hook_sites()`: every implementation registered on the manager,
plus the stack's worker-side implementations (a sampler raising inside an in-process
worker is named too). A failure with no plugin frame (the forward pass, the kernel itself)
gets no `PluginError`; the caller reports it as it is.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any


@dataclass(frozen=True, slots=True)
class HookSite:
    """One hook implementation: the plugin's name in the stack, the hook, the instance it
    is bound to (None for a class not instantiated on this side), whether it is a wrapper,
    and `where` (`file:line` of its definition)."""

    plugin: str
    hook: str
    instance: object | None
    wrapper: bool
    where: str


def definition_site(function: Any) -> str:
    """`file:line` of a function's definition (`?` when Python cannot tell)."""
    function = inspect.unwrap(getattr(function, "__func__", function))
    code = getattr(function, "__code__", None)
    if code is None:
        return "?"
    return f"{code.co_filename}:{code.co_firstlineno}"


class PluginError(RuntimeError):
    """A plugin's implementation of `hook` raised `cause`.

    `plugin`: its name in the stack; `hook`: the hook; `where`: `file:line` of the
    implementation's definition; `step`: the engine step it failed in (the number of steps
    completed before it), or None when it failed outside the step loop; `phase` says when
    in words (`engine step 3`, `stack start`, `add_request of request 'r1'`)."""

    def __init__(
        self,
        plugin: str,
        hook: str,
        where: str,
        phase: str,
        cause: BaseException,
        step: int | None = None,
    ) -> None:
        self.plugin, self.hook, self.where = plugin, hook, where
        self.phase, self.cause, self.step = phase, cause, step
        super().__init__(
            f"plugin {plugin!r} failed in hook {hook} ({where}) during {phase}: "
            f"{type(cause).__name__}: {cause}"
        )


def _frames(exc: BaseException) -> list[Any]:
    """Frames of `exc`'s traceback, outermost first, then those of the exception it was
    raised from or while handling (`__cause__`, `__context__`: the original failure comes
    last, so its frames are the innermost), at most 8 exceptions deep."""
    frames: list[Any] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 8:
        seen.add(id(current))
        frames += [frame for frame, _ in traceback.walk_tb(current.__traceback__)]
        current = current.__cause__ or current.__context__
    return frames


def failing_hook(
    exc: BaseException, sites: Mapping[CodeType, Sequence[HookSite]]
) -> HookSite | None:
    """The hook implementation that raised `exc`: the innermost traceback frame that runs
    a known implementation (a non-wrapper before a wrapper: a wrapper's frame is on the
    traceback of whatever it wraps). A code object shared by several plugins (one class
    stacked twice) is told apart by the frame's `self`. None when no plugin frame is on it.
    """
    found: HookSite | None = None
    for frame in _frames(exc):
        candidates = sites.get(frame.f_code)
        if not candidates:
            continue
        owner = frame.f_locals.get("self")
        site = next((s for s in candidates if s.instance is owner), candidates[0])
        if found is None or not site.wrapper or found.wrapper:
            found = site
    return found
