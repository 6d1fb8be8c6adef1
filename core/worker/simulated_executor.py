"""A simulated device in real time: tokens from the scripted model, time from a cost model
(`step_cost` hook, else the roofline of `parallel.simulated_device`). For simulated time
that runs faster than the wall clock, see `virtual_device.py`.

The "device" is one background thread. Each step computes the scripted model's tokens (fast)
and then sleeps until the step's modelled duration has passed, so the GIL is free and the
engine's CPU work can overlap with the device exactly as it would with a GPU. Every step
records its device span; `busy_fraction` is device time over wall time.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tandem.core.executor import Executor
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.model_loader import model_loader_for
from tandem.core.worker.step_shape import step_shape_of
from tandem.core.worker.virtual_device import step_seconds
from tandem.core.worker.worker import Worker
from tandem.schema.config import ConfigError, EngineConfig


@dataclass(slots=True)
class DeviceSpan:
    step_id: int
    kind: str  # "execute" or "sample"
    start: float
    end: float


class SimulatedExecutor(Executor):
    """Executes the scripted model on a device thread that sleeps for each step's modelled time."""

    runs_in_caller_process: ClassVar[bool] = True
    simulates_device: ClassVar[bool] = True

    def __init__(self, config: EngineConfig) -> None:
        if not model_loader_for(config.model.model).simulatable:
            raise ConfigError(
                "parallel.executor: 'simulated' runs only a model whose loader declares "
                f"`simulatable` (e.g. model: scripted), not {config.model.model!r}"
            )
        self.cost = config.parallel.simulated_device
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-sim-device")
        self.worker = self._device.submit(Worker, config).result()
        self.spans: list[DeviceSpan] = []
        self._lock = threading.Lock()
        self._device_free_at = 0.0

    def _run_on_device(self, step_id: int, kind: str, seconds: float, fn, *args):  # noqa: ANN001, ANN202
        start = max(time.perf_counter(), self._device_free_at)
        result = fn(*args)
        end = start + seconds
        delay = end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        end = max(end, time.perf_counter())
        self._device_free_at = end
        with self._lock:
            self.spans.append(DeviceSpan(step_id, kind, start, end))
        return result

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        hooks = [self.worker.plugin_manager.hook.step_cost]
        seconds = step_seconds(hooks, self.cost, step_shape_of(scheduler_output))
        return self._device.submit(
            self._run_on_device,
            scheduler_output.step_id,
            "execute",
            seconds,
            self.worker.execute_model,
            scheduler_output,
        )

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        return self._device.submit(
            self._run_on_device, -1, "sample", 0.0, self.worker.sample_tokens, grammar_bitmask
        )

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [self._device.submit(getattr(self.worker, method), *args).result()]

    def busy_fraction(self, since: float, until: float) -> float:
        """Fraction of [since, until] the device spent executing steps."""
        with self._lock:
            busy = sum(max(0.0, min(s.end, until) - max(s.start, since)) for s in self.spans)
        return busy / max(until - since, 1e-9)

    def shutdown(self) -> None:
        self._device.shutdown(wait=True)
