"""Executors: where the worker runs. `execute_model` and `sample_tokens` return futures.

The kernel never waits inside an executor call: it waits on the futures, so an executor
that runs the worker elsewhere (a thread, a process, a device) overlaps with the engine. The
implementations live with the worker (`tandem.core.worker.executors`, the simulated device).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

from tandem.core.plugin_manager import import_class
from tandem.schema.config import ConfigError, EngineConfig

if TYPE_CHECKING:  # this module stays torch-free: config resolution reads executor classes
    import torch

    from tandem.core.model_runner_output import ModelRunnerOutput
    from tandem.core.scheduler_output import SchedulerOutput


def completed(fn: Any, *args: Any) -> Future:
    """Run `fn(*args)` now and return a finished future holding its result or exception."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # the caller sees it through future.result()
        future.set_exception(exc)
    return future


class Executor(ABC):
    """Runs the worker (one per rank). Calls are made in step order; futures resolve in
    that order. An executor is found by name in the entry-point group `tandem.executors`
    (or as a `module:Class` path) and declares, as class attributes read without an
    instance, what the config resolution checks against:"""

    #: Whether the batch queue may hold more than one step in flight with this executor.
    supports_async_scheduling: ClassVar[bool] = True
    #: The worker runs in the caller's process (its torch threads are the caller's).
    runs_in_caller_process: ClassVar[bool] = False
    #: The most ranks it runs (`parallel.world_size`); None for no limit.
    max_world_size: ClassVar[int | None] = 1
    #: It models the device's time instead of running a real one (the simulated device).
    simulates_device: ClassVar[bool] = False

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]: ...

    @abstractmethod
    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]: ...

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """`getattr(worker, method)(*args)` on every rank's worker, between steps (never
        while a step is in flight); the results in rank order. Across a process boundary
        the arguments and results are plain data (numbers, strings, lists, dicts). The
        bundled executors implement it; an executor without workers raises."""
        raise NotImplementedError(f"{type(self).__name__} does not implement collective_rpc")

    def shutdown(self) -> None:  # noqa: B027 - optional override, not abstract
        """Release the workers' resources. Idempotent."""


EXECUTOR_GROUP = "tandem.executors"


def installed_executors() -> dict[str, str]:
    """Executor name -> `module:Class`, from the entry-point group `tandem.executors`."""
    from tandem.core.entry_points import plugin_entry_points

    return {ep.name: ep.value for ep in plugin_entry_points(EXECUTOR_GROUP)}


def executor_class(name: str) -> type[Executor]:
    """The executor `name` names: an installed executor's name or a `module:Class` path.
    ConfigError naming `parallel.executor` and the installed names otherwise."""
    installed = installed_executors()
    path = installed.get(name, name if ":" in name else None)
    if path is None:
        raise ConfigError(
            f"parallel.executor: {name!r} is not an installed executor; choose one of "
            f"{', '.join(sorted(installed))} or give a 'module:Class' path"
        )
    try:
        cls = import_class(path)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"parallel.executor: {name!r} ({path}) cannot be imported: {exc}"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ConfigError(f"parallel.executor: {name!r} ({path}) is not an Executor subclass")
    return cls


def make_executor(config: EngineConfig) -> Executor:
    return executor_class(config.parallel.executor)(config)
