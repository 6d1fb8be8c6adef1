"""A simulated device: tokens from the scripted model, time from a cost model.

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
from tandem.core.worker.worker import Worker
from tandem.schema.config import ConfigError, EngineConfig, SimulatedDeviceConfig


@dataclass(slots=True)
class DeviceSpan:
    step_id: int
    kind: str  # "execute" or "sample"
    start: float
    end: float


def modelled_step_seconds(
    cost: SimulatedDeviceConfig, num_tokens: int, context_tokens: int
) -> float:
    """Roofline time of one step: compute-bound or bandwidth-bound, whichever is slower."""
    if num_tokens == 0:
        return 0.0
    compute = num_tokens * cost.flops_per_token / cost.flops_per_s
    memory = (cost.weight_bytes + context_tokens * cost.kv_bytes_per_token) / cost.bytes_per_s
    return max(compute, memory)


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
        context = 0
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            context += self._context_before(req_id, scheduler_output) + n
        seconds = modelled_step_seconds(
            self.cost, scheduler_output.total_num_scheduled_tokens, context
        )
        return self._device.submit(
            self._run_on_device,
            scheduler_output.step_id,
            "execute",
            seconds,
            self.worker.execute_model,
            scheduler_output,
        )

    @staticmethod
    def _context_before(req_id: str, scheduler_output: SchedulerOutput) -> int:
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id == req_id:
                return new.num_computed_tokens
        for cached in scheduler_output.scheduled_cached_reqs:
            if cached.req_id == req_id:
                return cached.num_computed_tokens
        return 0

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
