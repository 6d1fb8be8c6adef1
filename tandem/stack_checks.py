"""Checks a plugin stack must pass at resolution, before any engine starts, so that
`tandem config show` fails on them naming the plugin and the implementation's `file:line`:

- every hook implementation's signature is one its hookspec accepts (pluggy's own check
  at `register`, run here on each implementation alone);
- at most one plugin answers each exclusive policy seam (`EXCLUSIVE_SEAMS`).

`resolve_config` runs them once; a worker that rebuilds the resolved stack in another
process does not repeat them.
"""

from __future__ import annotations

import functools
import inspect
import threading
from types import MethodType, SimpleNamespace

import pluggy

from tandem.core.hookspecs import EXCLUSIVE_SEAMS, PROJECT, EngineHookSpecs, WorkerHookSpecs
from tandem.core.plugin_error import definition_site
from tandem.core.plugin_manager import (
    ALL_HOOKS,
    PluginConfigError,
    ResolvedStack,
    implemented_hooks,
)
from tandem.schema.config import PluginSpec


@functools.cache
def _spec_manager() -> pluggy.PluginManager:
    """A manager holding only the hookspecs, for checking implementations against them."""
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(EngineHookSpecs)
    manager.add_hookspecs(WorkerHookSpecs)
    return manager


#: Serialises the checks on the shared manager (stacks may resolve on several threads).
_SPEC_MANAGER_LOCK = threading.Lock()

#: Stands for an instance when a hook implementation's signature is checked bound.
_INSTANCE = object()


def signature_errors(cls: type) -> list[str]:
    """Each hook implementation of `cls` that pluggy's own check (`register` against the
    hookspecs: argument names, wrapper shape) refuses, as `hook (file:line): why`. Run at
    stack resolution, so a bad signature fails `tandem config show`, not the first
    `generate`. Each implementation is registered alone, on a throwaway holder, and
    unregistered again."""
    errors = []
    manager = _spec_manager()
    for hook in sorted(implemented_hooks(cls) & ALL_HOOKS):
        function = getattr(cls, hook)
        # An instance method is checked bound, as `register` sees it on an instance (its
        # first parameter is the instance, whatever the function's name or where it was
        # defined); static and class methods are already what an instance exposes.
        raw = inspect.getattr_static(cls, hook)
        checked = MethodType(function, _INSTANCE) if inspect.isfunction(raw) else function
        holder = SimpleNamespace(**{hook: checked})
        name = f"signature-check:{hook}"
        with _SPEC_MANAGER_LOCK:
            try:
                manager.register(holder, name=name)
            except pluggy.PluginValidationError as exc:
                why = " ".join(str(exc).split("\n")[1:]) or str(exc)
                errors.append(f"{hook} ({definition_site(function)}): {why}")
            finally:
                # pluggy < 1.7 keeps the name of a plugin it refused: drop it either way,
                # or the next check of this hook fails with "already registered".
                if manager.get_plugin(name) is not None:
                    manager.unregister(name=name)
    return errors


def check_exclusive_seams(stack: ResolvedStack) -> None:
    """Refuse a stack in which two plugins answer the same exclusive policy seam
    (`EXCLUSIVE_SEAMS`: the WAITING order, the preemption victim; see their hookspecs):
    a first-result answer would silently shadow the other. The scheduler's own default
    answer (a plugin with the scheduler role) does not count."""
    for seam in EXCLUSIVE_SEAMS:
        answering = [
            e
            for e in stack.entries
            if e.cap("role") != "scheduler" and seam in implemented_hooks(e.cls)
        ]
        if len(answering) > 1:
            first, second = answering[0], answering[1]
            raise PluginConfigError(
                f"{second.where}: plugins {first.name!r} ({first.where}) and {second.name!r} "
                f"both answer {seam}, {EXCLUSIVE_SEAMS[seam]}; a stack takes one such "
                f"policy (the first answer would silently shadow the other): keep one, or "
                f"combine both rules in one plugin"
            )


def check_signatures(cls: type, spec: PluginSpec, where: str) -> None:
    """Raise `PluginConfigError` naming `where`, the plugin and each implementation of
    `cls` whose signature its hookspec refuses."""
    bad = signature_errors(cls)
    if bad:
        raise PluginConfigError(
            f"{where}: plugin {spec.name!r}: hook implementation does not match its "
            f"hookspec: {'; '.join(bad)}"
        )
