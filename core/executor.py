"""Executors: where the worker runs. `execute_model` and `sample_tokens` return futures.

The kernel never waits inside an executor call: it waits on the futures, so an executor
that runs the worker elsewhere (a thread, a process, a device) overlaps with the engine. The
implementations live with the worker (`tandem.core.worker.executors`, the simulated device).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, ClassVar

import torch

from tandem.config import ConfigError, EngineConfig
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
    """Runs the worker. Calls are made in step order; futures resolve in that order."""

    #: Whether the batch queue may hold more than one step in flight with this executor.
    supports_async_scheduling: ClassVar[bool] = True

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]: ...

    @abstractmethod
    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]: ...

    def shutdown(self) -> None:  # noqa: B027 - optional override, not abstract
        """Release the worker's resources. Idempotent."""


#: Executors by `parallel.executor` name: where each class lives (imported on first use).
EXECUTORS = {
    "inprocess": "tandem.core.worker.executors:InProcessExecutor",
    "thread": "tandem.core.worker.executors:ThreadExecutor",
    "process": "tandem.core.worker.executors:ProcessExecutor",
    "simulated": "tandem.core.worker.simulated_executor:SimulatedExecutor",
}


def executor_class(name: str) -> type[Executor] | None:
    """The executor class registered under `name`, or None for an unknown name."""
    module, _, cls = EXECUTORS.get(name, ":").partition(":")
    return getattr(importlib.import_module(module), cls) if module else None


def make_executor(config: EngineConfig) -> Executor:
    cls = executor_class(config.parallel.executor)
    if cls is None:
        raise ConfigError(
            f"parallel.executor: {config.parallel.executor!r} is not available; choose one of "
            f"{', '.join(EXECUTORS)}"
        )
    return cls(config)
