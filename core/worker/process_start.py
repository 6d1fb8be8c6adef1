"""How tandem starts its worker processes (the `process` executor's worker, `mp` ranks).

A spawned interpreter imports torch, transformers and tandem again: several seconds per
process, paid by every rank of every engine. So by default these processes come from a fork server (POSIX `forkserver`) that imports those modules once
(`PRELOAD`) and forks a child per start. The server is a fresh single-threaded process that
has only imported modules (no CUDA context, no thread pool, no sockets), so its forks are
as safe as spawned interpreters. Such a worker is a child of the fork server, not of the
engine that started it (it still ends with the engine: its pipe closes). A child takes the parent's environment and `sys.path` as
they are when it starts (`ParentState`), exactly what a spawned child would see, not the
server's (the server's are those of its own start).

`TANDEM_PROCESS_START=spawn` (or a platform without `forkserver`) starts each process with
spawn instead.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any

#: Imported once by the fork server: the modules every worker needs.
PRELOAD = (
    "torch",
    "tandem.core.worker.worker",
    "tandem.core.worker.executors",
    "tandem.models.hf_model",
)


def start_method() -> str:
    wanted = os.environ.get("TANDEM_PROCESS_START", "forkserver")
    if wanted not in ("forkserver", "spawn"):
        raise ValueError(f"TANDEM_PROCESS_START: expected 'forkserver' or 'spawn', got {wanted!r}")
    return wanted if wanted in mp.get_all_start_methods() else "spawn"


def process_context() -> BaseContext:
    """The multiprocessing context for tandem's processes (see the module docstring)."""
    method = start_method()
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(PRELOAD))  # takes effect when the server starts
    return context


@dataclass(frozen=True, slots=True)
class ParentState:
    """What a spawned child inherits and a forked one must be given: the environment and
    the import path, captured when the child is started."""

    env: dict[str, str]
    sys_path: list[str]

    @classmethod
    def capture(cls) -> ParentState:
        return cls(dict(os.environ), list(sys.path))

    def adopt(self) -> None:
        os.environ.clear()
        os.environ.update(self.env)
        sys.path[:] = self.sys_path


def run_as_child(state: ParentState, target: Callable[..., Any], *args: Any) -> Any:
    """A child's entry point: adopt the parent's state, then run `target(*args)`."""
    state.adopt()
    return target(*args)


def start_process(
    target: Callable[..., Any], args: tuple[Any, ...], name: str, daemon: bool | None = None
) -> Any:
    """Start `target(*args)` in a new process (`process_context`) with the caller's
    environment and import path; returns the started `Process`."""
    context = process_context()
    process = context.Process(  # type: ignore[attr-defined]
        target=run_as_child,
        args=(ParentState.capture(), target, *args),
        name=name,
        daemon=daemon,
    )
    process.start()
    return process
