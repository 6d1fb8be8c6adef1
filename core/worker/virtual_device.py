"""A simulated device on a virtual clock: no sleeping, the clock jumps to each step's end.

`VirtualDeviceExecutor` runs the scripted model in the caller's thread (tokens are cheap)
and keeps the device's timeline on a `VirtualClock`: a step starts when both the engine has
planned it and the device is free, and lasts what the cost model says (`step_cost` hook,
else the roofline of `parallel.simulated_device`). The engine waits for a step only through
the step's future, whose `result()` moves the clock to the step's end; so under async
scheduling the next step is planned while the previous one "runs", and the overlap falls
out of the event order instead of a formula.

The engine's own CPU time per step reaches the clock one of two ways (`EngineTime`):
`modelled` (the default) charges `step_s + per_request_s * requests` when a step is handed
to the device: deterministic, so one input gives one result on any machine, and its two
numbers come from `tandem simulate calibrate`; `measured` charges the wall time the engine
spent between device calls (scheduling, updates, grammar masks), scaled by `scale`: it
follows the real plugins' cost but varies with this machine's load.

A block-diffusion model (a resolved `diffusion` section) gets `DiffusionTokenOracle` for its
canvas steps and canvas-aware step shapes. A KV connector's transfers (`connector_plan`)
are timed as the engine's worker runs them: local loads and saves lengthen the step whose
plan carries them (`StepShape.kv_load_blocks` / `kv_save_blocks`, priced by the cost
model); remote loads run beside the steps on one simulated loader, each priced as a shape
with no tokens and only `kv_remote_blocks`, and (with the token oracle) the request is
reported in `finished_recving` by the first step that ends after its load does, or its own
local loads' step for a `recv` in the plan.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tandem.core.clock import VirtualClock
from tandem.core.executor import Executor
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.plugin_manager import implemented_hooks, stack_of
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.connector_plan import (
    ConnectorTransfers,
    RemoteLoads,
    connector_transfers,
)
from tandem.core.worker.diffusion_oracle import DiffusionTokenOracle
from tandem.core.worker.grammar_tokens import GrammarTokens
from tandem.core.worker.model_loader import model_loader_for
from tandem.core.worker.step_shape import StepShape, step_shape_of
from tandem.core.worker.token_oracle import TokenOracle
from tandem.core.worker.worker import Worker
from tandem.kv.connector import KVConnectorOutput
from tandem.schema.config import ConfigError, EngineConfig, SimulatedDeviceConfig


@dataclass(frozen=True, slots=True)
class EngineTime:
    """How the engine's CPU time per step is charged to the virtual clock.

    `mode`: "modelled" (`step_s` + `per_request_s` x scheduled requests, per step) or
    "measured" (wall seconds between device calls x `scale`). `output_s` (either mode):
    how long a step's outputs take to reach the client after the step ends (a serving
    front end's hop: the engine-core process to the API process, output processing); it
    delays the tokens and finishes the report sees (and a closed-loop client's next
    request), not the engine's next step."""

    mode: str = "modelled"
    step_s: float = 0.0
    per_request_s: float = 0.0
    scale: float = 1.0
    output_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("modelled", "measured"):
            raise ValueError(
                f"engine_time.mode: expected 'modelled' or 'measured', got {self.mode!r}"
            )
        if min(self.step_s, self.per_request_s, self.scale, self.output_s) < 0:
            raise ValueError("engine_time: step_s, per_request_s, scale and output_s must be >= 0")


def roofline_seconds(cost: SimulatedDeviceConfig, step: StepShape) -> float:
    """The bare roofline of `parallel.simulated_device`: compute- or bandwidth-bound,
    whichever is slower (weights read once, each request's KV once, `flops_per_token` per
    token). The default when no `step_cost` plugin answers."""
    if step.num_tokens == 0:
        return 0.0
    compute = step.num_tokens * cost.flops_per_token / cost.flops_per_s
    kv_tokens = sum(step.context_lens) + step.num_tokens
    memory = (cost.weight_bytes + kv_tokens * cost.kv_bytes_per_token) / cost.bytes_per_s
    return max(compute, memory)


def step_seconds(
    cost_hooks: list[Any], simulated_device: SimulatedDeviceConfig, shape: StepShape
) -> float:
    """Seconds of one step: the first `step_cost` answer that is not None, else the bare
    roofline of `simulated_device` (which prices no connector transfer); 0 for a step
    without tokens or transfers. Raises ValueError for an answer that is not a number >= 0."""
    if shape.num_tokens == 0 and not shape.has_transfers:
        return 0.0
    answer = None
    for hook in cost_hooks:
        if (answer := hook(step=shape)) is not None:
            break
    seconds = answer if answer is not None else roofline_seconds(simulated_device, shape)
    if not seconds >= 0:
        raise ValueError(f"step_cost: expected seconds >= 0, got {seconds!r}")
    return float(seconds)


class DeviceFuture(Future):
    """A step's result, computed already; `result()` first moves the clock to `done_at`.
    A step's sampled output (`num_tokens` set: the step's scheduled tokens) also tells the
    executor what the engine collected (`collected_tokens`, `news`)."""

    def __init__(
        self,
        executor: VirtualDeviceExecutor,
        done_at: float,
        value: Any,
        num_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.executor, self.done_at, self.num_tokens = executor, done_at, num_tokens
        self.set_result(value)

    def result(self, timeout: float | None = None) -> Any:
        self.executor.wait_until(self.done_at)
        value = super().result(timeout)
        if self.num_tokens is not None:
            self.executor.collected_tokens = self.num_tokens
        connector = getattr(value, "kv_connector_output", None)
        if connector is not None and connector.finished_recving:
            self.executor.news = True
        return value


def cost_models(config: EngineConfig) -> list[Any]:
    """The stack's `step_cost` plugins, constructed, in stack order (without the rest of
    the worker side: the oracle needs no sampler or drafter objects)."""
    models = []
    for entry in stack_of(config).entries:
        if "step_cost" in implemented_hooks(entry.cls):
            models.append(entry.cls(config, entry.options))
    return models


class VirtualDeviceExecutor(Executor):
    """A device whose time is a `VirtualClock`, with tokens from `tokens`: "oracle" (the
    default: `TokenOracle` counts which requests sample, `DiffusionTokenOracle` which
    canvases commit, with `denoise_tokens_per_step` its denoising model; no model, no KV
    tensors) or "worker" (the scripted model through the real worker and model runner, so
    every worker-side plugin runs too, at about 3x the wall time per step).

    Built by the simulation driver and handed to `EngineCore(executor=..., clock=clock)`
    with the same clock. Counters: `num_steps` (steps with tokens), `busy_s` (device
    seconds), `device_free_at` (end of the last step on the clock). `on_step`, when set, is
    called with (start, end, scheduler_output, shape) for every step with tokens.
    """

    runs_in_caller_process: ClassVar[bool] = True
    simulates_device: ClassVar[bool] = True

    def __init__(
        self,
        config: EngineConfig,
        clock: VirtualClock,
        engine_time: EngineTime | None = None,
        tokens: str = "oracle",
        acceptance_rate: float = 0.0,
        seed: int = 0,
        parallel: tuple[int, int] | None = None,
        overlap: bool = True,
        denoise_tokens_per_step: int | None = None,
    ) -> None:
        if not model_loader_for(config.model.model).simulatable:
            raise ConfigError(
                "the virtual device runs only a model whose loader declares `simulatable` "
                f"(e.g. model: scripted), not {config.model.model!r}"
            )
        self.config, self.clock = config, clock
        self.engine_time = engine_time if engine_time is not None else EngineTime()
        if tokens not in ("oracle", "worker"):
            raise ConfigError(f"tokens: expected 'oracle' or 'worker', got {tokens!r}")
        self.worker: Worker | None = None
        self.oracle: TokenOracle | DiffusionTokenOracle | None = None
        diffusion = getattr(config, "diffusion", None)
        self.diffusion = diffusion is not None
        if tokens == "worker":
            self.worker = Worker(config)
            self.cost_hooks = [self.worker.plugin_manager.hook.step_cost]
        elif diffusion is not None:
            self.oracle = DiffusionTokenOracle(
                diffusion.max_denoising_steps,
                diffusion.stability_threshold,
                denoise_tokens_per_step,
            )
            self.cost_hooks = [model.step_cost for model in cost_models(config)]
        else:
            spec = config.speculative
            num_spec = spec.num_speculative_tokens if spec is not None else 0
            self.oracle = TokenOracle(2, num_spec or 0, acceptance_rate, seed)
            self.cost_hooks = [model.step_cost for model in cost_models(config)]
        self._pending: ModelRunnerOutput | None = None
        self._pending_step: SchedulerOutput | None = None  # the step `_pending` answers
        model = config.model
        self.grammar_tokens = GrammarTokens(model.vocab_size or 1, model.eos_token_id, seed)
        self.parallel = parallel or (
            config.parallel.tensor_parallel_size,
            config.parallel.pipeline_parallel_size,
        )
        #: False: the device is the engine's own thread (a CPU engine with the `inprocess`
        #: executor computes a step before `execute_model` returns): the clock moves to a
        #: step's end when it is handed over, so engine and device time never overlap.
        self.overlap = overlap
        self.device_free_at = clock.now()
        self.remote_loads = RemoteLoads(clock.now())
        #: A step output the engine collected reported loads over (`take_news`).
        self.news = False
        #: Scheduled tokens of the last step whose output the engine collected (None: none
        #: since the driver reset it): 0 is when the real engine would wait for work.
        self.collected_tokens: int | None = None
        self._step_tokens = 0
        self.busy_s, self.num_steps = 0.0, 0
        self.on_step: Any = None
        self._mark = time.perf_counter()

    # Engine time ------------------------------------------------------------------------
    def _charge_measured(self) -> None:
        if self.engine_time.mode == "measured":
            spent = (time.perf_counter() - self._mark) * self.engine_time.scale
            self.clock.advance_to(self.clock.now() + spent)

    def mark(self) -> None:
        """Start a new measured interval here: time before it is not the engine's (the
        driver calls it after its own bookkeeping)."""
        self._mark = time.perf_counter()

    def wait_until(self, t: float) -> None:
        """The engine blocks until the device reaches `t` (a step's end)."""
        self._charge_measured()
        self.clock.advance_to(max(self.clock.now(), t))
        self.mark()

    # Device ----------------------------------------------------------------------------
    def step_seconds(self, shape: StepShape) -> float:
        """The cost model's answer for `shape` (seconds >= 0)."""
        return step_seconds(self.cost_hooks, self.config.parallel.simulated_device, shape)

    @property
    def next_transfer_end_s(self) -> float | None:
        """When the earliest transfer running now ends: a remote load, or a step that only
        moves blocks (an asynchronous local load); None: none runs. The driver's idle clock
        stops there instead of polling past it."""
        now = self.clock.now()
        ends = (self.remote_loads.next_end, self.device_free_at)
        return min((t for t in ends if t is not None and t > now), default=None)

    def take_news(self) -> bool:
        """Whether an output collected since the last call reported asynchronous loads
        over: their requests can be admitted at once, so an idle engine steps again
        without waiting (the engine's own loop does not sleep then)."""
        news, self.news = self.news, False
        return news

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        self._charge_measured()
        block_size = self.config.cache.block_size
        transfers = connector_transfers(scheduler_output.kv_connector_metadata)
        shape = step_shape_of(
            scheduler_output,
            *self.parallel,
            diffusion=self.diffusion,
            block_size=block_size,
            transfers=transfers,
        )
        if self.engine_time.mode == "modelled" and shape.num_reqs:
            spent = self.engine_time.step_s + self.engine_time.per_request_s * shape.num_reqs
            self.clock.advance_to(self.clock.now() + spent)
        seconds = self.step_seconds(shape)
        self._step_tokens = shape.num_tokens
        start = max(self.clock.now(), self.device_free_at)
        self.device_free_at = end = start + seconds
        self.busy_s += seconds
        if seconds > 0 and shape.num_tokens:
            self.num_steps += 1
            if self.on_step is not None:
                self.on_step(start, end, scheduler_output, shape)
        if self.worker is not None:
            self.worker.execute_model(scheduler_output)
        else:
            self._pending = self._oracle_step(scheduler_output, transfers, shape, start, end)
            self._pending_step = scheduler_output
        self.mark()
        if not self.overlap:
            self.wait_until(end)
        return DeviceFuture(self, end, None)

    def _oracle_step(
        self,
        scheduler_output: SchedulerOutput,
        transfers: ConnectorTransfers,
        shape: StepShape,
        start: float,
        end: float,
    ) -> ModelRunnerOutput:
        """The oracle's output for a step running [start, end), with the connector output
        the worker side would give: the plan's `recv` (its local loads run in this step) and
        the remote loads that ended by `end` as `finished_recving`, the tokens moved."""
        assert self.oracle is not None
        for rid, blocks in transfers.remote:  # handed to the loader when the step starts
            load = StepShape((), (), kv_remote_blocks=blocks, kv_block_size=shape.kv_block_size)
            self.remote_loads.start(rid, start, self.step_seconds(load))
        output = self.oracle.step(scheduler_output)
        recving = set(transfers.recv) | self.remote_loads.finished_by(end)
        if recving or shape.kv_load_blocks or shape.kv_save_blocks:
            stats = {
                "loaded_tokens": float(shape.kv_load_blocks * shape.kv_block_size),
                "saved_tokens": float(shape.kv_save_blocks * shape.kv_block_size),
            }
            output.kv_connector_output = KVConnectorOutput(finished_recving=recving, stats=stats)
        return output

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        self._charge_measured()
        if self.worker is not None:
            output = self.worker.sample_tokens(grammar_bitmask)
        else:
            output, self._pending = self._pending or ModelRunnerOutput(), None
            step, self._pending_step = self._pending_step, None
            if (
                grammar_bitmask is not None
                and step is not None
                and isinstance(self.oracle, TokenOracle)
            ):
                self.grammar_tokens.apply(output, step, grammar_bitmask, self.oracle)  # valid ids
        self.mark()
        return DeviceFuture(self, self.device_free_at, output, self._step_tokens)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if self.worker is None:
            raise RuntimeError(f"collective_rpc({method!r}): the token oracle has no worker")
        return [getattr(self.worker, method)(*args)]
