"""A worker: its own plugin manager (over the config's resolved stack), a model, a runner."""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

import torch

from tandem.core.executor import executor_class
from tandem.core.model_runner_output import AsyncModelRunnerOutput, ModelRunnerOutput
from tandem.core.plugin_manager import TandemPluginManager
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker import parallel_state
from tandem.core.worker.block_diffusion import is_block_diffusion
from tandem.core.worker.cpu_affinity import allowed_cpus
from tandem.core.worker.diffusion_runner import DiffusionRunner
from tandem.core.worker.host_heap import pin_mmap_threshold, trim_threshold_for
from tandem.core.worker.kv_memory import fitting_blocks
from tandem.core.worker.kv_transfer import KVTransfer
from tandem.core.worker.load_governor import LoadGovernor
from tandem.core.worker.model_loader import load_step_model
from tandem.core.worker.model_runner import ModelRunner, StepModel
from tandem.core.worker.threads import set_worker_threads
from tandem.schema.config import EngineConfig


class Worker:
    """Runs steps for the engine. Built from the config alone, so it can live in another
    thread or process: no live plugin object is shared with the engine. In another process
    the stack is rebuilt from `config.resolved_stack` (classes imported by path)."""

    def __init__(self, config: EngineConfig, model: StepModel | None = None) -> None:
        set_worker_threads(config)
        pin_mmap_threshold(trim_threshold_for(config.model.dtype))
        self.config = config
        self.plugin_manager = TandemPluginManager(config, side="worker", source=config.source)
        self.model = model if model is not None else load_step_model(config)
        self.model_runner = make_runner(config, self.model, self.plugin_manager)
        #: The stack's KV connector around each forward (None: no connector).
        self.kv_transfer = KVTransfer.of(
            self.plugin_manager.hook, self.model, config.cache.block_size
        )

        #: The last steps' `execute_model` spans: (step id, start, end), `time.monotonic()`
        #: (one clock for every process on a host: ranks' lanes line up).
        self.spans: deque[tuple[int, float, float]] = deque(maxlen=4096)
        #: Fewer threads while other processes load the machine (`parallel.yield_to_load`).
        self.load_governor = load_governor(config) if self.model.device.type == "cpu" else None

    def describe(self) -> dict[str, Any]:
        """This worker's place and resources, as plain data (`collective_rpc("describe")`):
        rank, world size, tensor-parallel rank and size, host, pid, torch threads, device,
        the KV heads its pool holds (None for a model without a paged pool), and the time,
        calls and bytes of its collectives so far, and the checkpoint bytes its model read and
        which of its weights are quantized (`model.quantization` as resolved)."""
        info = parallel_state.current()
        pools = getattr(self.model, "kv_caches", None)
        return {
            "rank": info.rank,
            "world_size": info.world_size,
            "tp_rank": info.tp_rank,
            "tp_size": info.tp_size,
            "host": info.host,
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "device": str(self.model.device),
            "kv_heads": int(pools[0][1].shape[2]) if pools else None,
            "collective_s": parallel_state.collective_time.seconds,
            "collective_calls": parallel_state.collective_time.calls,
            "collective_bytes": parallel_state.collective_time.bytes,
            "bytes_read": getattr(self.model, "bytes_read", None),
            "quantization": getattr(self.model, "quantization", None),
        }

    def kv_cache_capacity(self) -> dict[str, int | None]:
        """This rank's pool (`blocks`) and how many blocks of it its device can hold
        (`fits`, `kv_memory.fitting_blocks`); None for a model without paged pools."""
        pools = getattr(self.model, "kv_caches", None)
        if not pools:
            return {"blocks": None, "fits": None}
        blocks = int(pools[0][0].shape[0])
        block_bytes = sum(k[0].nbytes + v[0].nbytes for k, v in pools)
        fits = fitting_blocks(
            self.model.device,
            block_bytes,
            block_bytes * blocks,
            parallel_state.current().local_world_size,
            self.config.cache.gpu_memory_utilization,
        )
        return {"blocks": blocks, "fits": fits}

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Reallocate every pool with `num_blocks` blocks (before any step: the pools hold
        nothing yet); each old pool is released before its replacement is allocated."""
        pools = self.model.kv_caches
        for i in range(len(pools)):
            specs = [((num_blocks, *t.shape[1:]), t.dtype, t.device) for t in pools[i]]
            pools[i] = None  # the old pair's memory goes before the new pair is allocated
            k, v = (torch.empty(shape, dtype=dtype, device=dev) for shape, dtype, dev in specs)
            pools[i] = (k, v)

    def step_spans(self) -> list[tuple[int, float, float]]:
        """`spans` as plain data (`collective_rpc("step_spans")`)."""
        return list(self.spans)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self.load_governor is not None:
            threads = self.load_governor.threads()
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        start = time.monotonic()
        if self.kv_transfer is None:
            self.model_runner.execute_model(scheduler_output)
        else:
            self.kv_transfer.run_step(
                scheduler_output, lambda: self.model_runner.execute_model(scheduler_output)
            )
        self.spans.append((scheduler_output.step_id, start, time.monotonic()))

    def sample_tokens(
        self, grammar_bitmask: torch.Tensor | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """The step's output; under async scheduling possibly still being copied to the
        host (the engine resolves it with `resolve_output`)."""
        output = self.model_runner.sample_tokens(grammar_bitmask)
        return output if self.kv_transfer is None else self.kv_transfer.attach(output)


def make_runner(
    config: EngineConfig, model: StepModel, plugin_manager: TandemPluginManager
) -> ModelRunner | DiffusionRunner:
    """The runner the model's loader declared: `DiffusionRunner` for a block-diffusion model
    (a loader with `is_diffusion`, resolved into `config.diffusion`), else `ModelRunner`."""
    if config.diffusion is not None:
        if not is_block_diffusion(model):
            raise TypeError(
                f"model.model: the loader declared a block-diffusion model but built "
                f"{type(model).__name__}, which lacks encode/denoise/canvas_length"
            )
        return DiffusionRunner(
            model, plugin_manager.hook, config.cache.block_size, config.scheduler.max_num_seqs
        )
    return ModelRunner(
        model=model,
        hooks=plugin_manager.hook,
        block_size=config.cache.block_size,
        num_spec_tokens=config.num_spec_tokens,
        async_scheduling=bool(config.scheduler.async_scheduling),
        keep_hidden_states=plugin_manager.resolved.needs_hidden_states,
        max_num_reqs=config.scheduler.max_num_seqs,
    )


def load_governor(config: EngineConfig) -> LoadGovernor | None:
    """The worker's `LoadGovernor` when `parallel.yield_to_load` asks for one and the thread
    count may move (more than one thread, no CPU pinning, a real device)."""
    parallel = config.parallel
    threads = parallel.worker_num_threads or 1
    if not parallel.yield_to_load or threads == 1 or parallel.cpu_bind != "none":
        return None
    if executor_class(parallel.executor).simulates_device:
        return None
    return LoadGovernor(threads, len(allowed_cpus()))
