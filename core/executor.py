"""Executors: where the worker runs. `execute_model` and `sample_tokens` return futures.

The kernel never waits inside an executor call: it waits on the futures, so an executor
that runs the worker elsewhere (a thread, a process, a device) overlaps with the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, ClassVar, TypeVar

import torch

from tandem.core.config import ConfigError, EngineConfig
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.worker import Worker

T = TypeVar("T")


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


class InProcessExecutor(Executor):
    """The worker runs in the caller's thread; futures are already resolved when returned.

    Async semantics (steps queued, results consumed later) without overlap: the executor
    the correctness tests use.
    """

    def __init__(self, config: EngineConfig, worker: Worker | None = None) -> None:
        self.worker = worker if worker is not None else Worker(config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        return completed(self.worker.execute_model, scheduler_output)

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        return completed(self.worker.sample_tokens, grammar_bitmask)


EXECUTORS: dict[str, type[Executor]] = {"inprocess": InProcessExecutor}


def executor_class(name: str) -> type[Executor] | None:
    """The executor registered under `name` (thread and process load on first use)."""
    if name in ("thread", "process") and name not in EXECUTORS:
        from tandem.core.worker.executors import ProcessExecutor, ThreadExecutor

        EXECUTORS.update(thread=ThreadExecutor, process=ProcessExecutor)
    if name == "simulated" and name not in EXECUTORS:
        from tandem.core.worker.simulated_executor import SimulatedExecutor

        EXECUTORS["simulated"] = SimulatedExecutor
    return EXECUTORS.get(name)


def make_executor(config: EngineConfig) -> Executor:
    name = config.parallel.executor
    if executor_class(name) is None:
        raise ConfigError(
            f"parallel.executor: {name!r} is not available; choose one of inprocess, thread, process, simulated"
        )
    return EXECUTORS[name](config)
