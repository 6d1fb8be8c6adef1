"""An analytic roofline cost model of one engine step, and its plugin (`roofline-cost`).

A step's seconds are the sum of its phases (`breakdown`), each the slower of its compute
time and its memory time on one rank (`DeviceSpec`), at efficiency factors (`CostFactors`):

- linear: max(2 x active layer params x tokens / (flops x mfu),
  weight bytes / (bandwidth x bandwidth_efficiency)). Weight bytes are the layers' (an MoE:
  only the experts the batch touches, `ModelShape.touched_experts`) plus the LM head's,
  read once per step. Each of the tp ranks holds 1/tp of the weights and does 1/tp of the
  FLOPs.
- attention, per request with q new tokens over c cached ones, summed over the batch:
  FLOPs 4 x layers x heads x head_dim x q x (c + (q+1)/2) (causal; sliding layers cap the
  keys at their window), KV bytes read kv_bytes_per_token x (c + q);
  max(FLOPs / (flops x attention_efficiency), bytes / (bandwidth x bandwidth_efficiency)),
  heads split over tp (KV heads: ceil(kv_heads / tp) per rank, replicated below tp).
- lm_head: 2 x hidden x vocab x num_sampled FLOPs at mfu, vocab split over tp (its weight
  bytes are in linear's, as if read every step).
- tp_comm: two all-reduces per layer of tokens x hidden x dtype_bytes, a ring:
  2 (tp-1)/tp x bytes / (link x comm_efficiency) + the device's collective latency.
- pp_comm: pp - 1 point-to-point sends of tokens x hidden x dtype_bytes over the link.
- overhead: `step_overhead_s`, a fixed per-step launch/host time.
- kv_load, kv_save, kv_remote: a KV connector's blocks (`StepShape.kv_*_blocks`) over the
  host link or the network (`links.py`: blocks x block bytes / (bandwidth x efficiency)).
  Loads and saves add to the step (the worker waits for them before and after the
  forward); a remote load is priced alone, on a shape with no tokens (it runs beside the
  steps). A shape with transfers but no tokens costs only its transfers.

Pipeline parallelism: the layers are split over the stages as the engine splits them
(even, the remainder on the earliest stages) and one micro-batch passes them in turn, so
the layer phases are the sum of the stage times (about the per-stage time x pp); no
micro-batch interleaving is modelled. Each stage is taken to hold the model's mix of layer
types. A step with no tokens and no transfers costs 0.

Block-diffusion steps (`StepShape.canvas_lens`): a request's causal tokens are a chunk as
above; its canvas of k positions after a context of n tokens (cached ones and the causal
tokens of this step) is the bidirectional decoder: every position attends to the visible
context (min(n, window) on a sliding layer) and to all k canvas positions, FLOPs
4 x layers x heads x head_dim x k x (visible + k); KV bytes read: the visible context only
(the canvas's own K/V are not cached). Every canvas position has logits (`num_sampled`).
The linear phase is summed over the step's forward passes (`StepShape.pass_tokens`: the
encode, one decoder pass per canvas length), each max(compute, its weight reads).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin
from tandem.core.worker.step_shape import StepShape
from tandem.plugins.cost_models.links import (
    DEFAULT_NETWORK_BANDWIDTH,
    DEFAULT_TRANSFER_EFFICIENCY,
    TRANSFER_TERMS,
    TransferLinks,
    transfer_seconds,
)
from tandem.plugins.cost_models.shapes import (
    DEVICE_NAMES,
    MODEL_NAMES,
    AttentionGroup,
    DeviceSpec,
    ModelShape,
    device_spec,
    model_shape,
)
from tandem.schema.config import EngineConfig

#: The phases of `breakdown`, in order.
FORWARD_TERMS: tuple[str, ...] = (
    "linear",
    "attention",
    "lm_head",
    "tp_comm",
    "pp_comm",
    "overhead",
)
TERMS: tuple[str, ...] = FORWARD_TERMS + TRANSFER_TERMS


@dataclass(frozen=True, slots=True)
class CostFactors:
    """Fractions of the device's peaks a step reaches, and a fixed per-step time.

    `mfu`: of peak FLOP/s in linear layers and the LM head; `attention_efficiency`: of peak
    FLOP/s in attention; `bandwidth_efficiency`: of peak memory bandwidth;
    `comm_efficiency`: of link bandwidth in collectives. Each in (0, 1].
    `step_overhead_s` >= 0: seconds added to every step with tokens (kernel launches, host
    work the device waits for; about 2e-3 for an eager step, near 0 under CUDA graphs).
    """

    mfu: float = 0.6
    attention_efficiency: float = 0.4
    bandwidth_efficiency: float = 0.8
    comm_efficiency: float = 0.7
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("mfu", "attention_efficiency", "bandwidth_efficiency", "comm_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if self.step_overhead_s < 0:
            raise ValueError("step_overhead_s must be >= 0")


def stage_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage: an even split, the remainder on the earliest stages."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} must be in [1, {num_layers}] (layers)")
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def _linear_s(shape: ModelShape, device: DeviceSpec, step: StepShape, f: CostFactors) -> float:
    """Sum over stages and forward passes of max(compute, memory) of the layers' linear
    weights (the last stage's last pass also reads the LM head)."""
    tp = step.tensor_parallel_size
    flops_per_s = device.peak_flops * f.mfu * tp
    bytes_per_s = device.mem_bandwidth * f.bandwidth_efficiency * tp
    active = shape.layer_params(shape.num_experts_per_tok)
    passes = [
        (
            2 * active * tokens / flops_per_s,
            shape.layer_params(shape.touched_experts(tokens) if shape.is_moe else None)
            * shape.dtype_bytes
            / bytes_per_s,
        )
        for tokens in step.pass_tokens()
    ]
    head = shape.lm_head_params() * shape.dtype_bytes / bytes_per_s
    counts = stage_layer_counts(shape.num_hidden_layers, step.pipeline_parallel_size)
    total = 0.0
    for s, layers in enumerate(counts):
        fraction = layers / shape.num_hidden_layers
        for p, (compute, memory) in enumerate(passes):
            last = head if s == len(counts) - 1 and p == len(passes) - 1 else 0.0
            total += max(fraction * compute, fraction * memory + last)
    return total


def canvas_keys_attended(group: AttentionGroup, context: int, canvas: int) -> float:
    """Keys summed over a canvas's `canvas` positions after `context` tokens, one layer
    and one head: each sees the visible context (capped at the group's window) and the
    whole canvas (bidirectional)."""
    visible = min(context, group.window) if group.window > 0 else context
    return canvas * (visible + canvas)


def canvas_keys_read(group: AttentionGroup, context: int) -> int:
    """Cached KV entries one layer reads for a canvas: the visible context only."""
    return min(context, group.window) if group.window > 0 else context


def _attention_s(shape: ModelShape, device: DeviceSpec, step: StepShape, f: CostFactors) -> float:
    """max(FLOPs at attention_efficiency, KV bytes at bandwidth_efficiency), per rank."""
    tp = step.tensor_parallel_size
    flops = 0.0
    kv_bytes = 0.0
    for group in shape.attention_groups():
        per_key = 4 * group.num_layers * shape.num_attention_heads * group.head_dim
        kv_heads = math.ceil(group.num_kv_heads / tp)  # this rank's, replicated below tp
        per_token = 2 * group.num_layers * kv_heads * group.head_dim * shape.dtype_bytes
        for i, (q, c) in enumerate(zip(step.query_lens, step.context_lens, strict=True)):
            canvas = step.canvas_len(i)
            causal = q - canvas
            if causal > 0:
                flops += per_key * group.keys_attended(c, causal) / tp
                kv_bytes += per_token * group.keys_read(c, causal)
            if canvas > 0:
                flops += per_key * canvas_keys_attended(group, c + causal, canvas) / tp
                kv_bytes += per_token * canvas_keys_read(group, c + causal)
    compute = flops / (device.peak_flops * f.attention_efficiency)
    memory = kv_bytes / (device.mem_bandwidth * f.bandwidth_efficiency)
    return max(compute, memory)


def _tp_comm_s(shape: ModelShape, device: DeviceSpec, step: StepShape, f: CostFactors) -> float:
    """Two ring all-reduces per layer (after attention and after the MLP); 0 on one rank."""
    tp = step.tensor_parallel_size
    if tp == 1:
        return 0.0
    nbytes = step.num_tokens * shape.hidden_size * shape.dtype_bytes
    link = device.link_bandwidth * f.comm_efficiency
    one = 2 * (tp - 1) / tp * nbytes / link + device.collective_latency_s
    return 2 * shape.num_hidden_layers * one


def _pp_comm_s(shape: ModelShape, device: DeviceSpec, step: StepShape, f: CostFactors) -> float:
    """pp - 1 sends of the hidden states between consecutive stages; 0 with one stage."""
    pp = step.pipeline_parallel_size
    nbytes = step.num_tokens * shape.hidden_size * shape.dtype_bytes
    one = nbytes / (device.link_bandwidth * f.comm_efficiency) + device.collective_latency_s
    return (pp - 1) * one


def breakdown(
    shape: ModelShape,
    device: DeviceSpec,
    step: StepShape,
    factors: CostFactors | None = None,
    links: TransferLinks | None = None,
) -> dict[str, float]:
    """Seconds of each phase of `step` (keys `TERMS`, all >= 0; the forward's all 0
    without tokens); transfers over `links` (None: `TransferLinks.for_device(device)`).
    Raises ValueError for parallel sizes below 1 or more stages than layers."""
    f = factors or CostFactors()
    if step.tensor_parallel_size < 1:
        raise ValueError("tensor_parallel_size must be >= 1")
    transfers = dict.fromkeys(TRANSFER_TERMS, 0.0)
    if step.has_transfers:
        transfers = transfer_seconds(shape, step, links or TransferLinks.for_device(device))
    if step.num_tokens == 0:
        return dict.fromkeys(FORWARD_TERMS, 0.0) | transfers
    lm_head_flops = 2 * shape.lm_head_params() * step.num_sampled
    return {
        "linear": _linear_s(shape, device, step, f),
        "attention": _attention_s(shape, device, step, f),
        "lm_head": lm_head_flops / (device.peak_flops * f.mfu * step.tensor_parallel_size),
        "tp_comm": _tp_comm_s(shape, device, step, f),
        "pp_comm": _pp_comm_s(shape, device, step, f),
        "overhead": f.step_overhead_s,
    } | transfers


def roofline_seconds(
    shape: ModelShape,
    device: DeviceSpec,
    step: StepShape,
    factors: CostFactors | None = None,
    links: TransferLinks | None = None,
) -> float:
    """Seconds the device takes for `step`: the sum of `breakdown`'s phases (0.0 without
    tokens and transfers)."""
    return sum(breakdown(shape, device, step, factors, links).values())


def _efficiency(default: float, what: str) -> float:
    return Field(default, gt=0, le=1, description=what)


class RooflineCostModel(TandemPlugin):
    """The `step_cost` answer of `roofline_seconds` for one model shape on one device.

    Options name the model (`model`, a named shape, or `model_config_path`, an operator's
    config.json; not both), the device and the efficiency factors (`CostFactors`). Unknown
    names and unreadable configs are errors when the plugin is built, naming the option.
    """

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid", protected_namespaces=())
        model: str = Field("llama-3-8b", description=f"named shape: {', '.join(MODEL_NAMES)}")
        model_config_path: str | None = Field(
            None, description="an HF config.json to read the shape from (instead of model)"
        )
        device: str = Field("h100", description=f"named device: {', '.join(DEVICE_NAMES)}")
        dtype_bytes: int = Field(2, gt=0, le=8, description="bytes per weight/KV element")
        mfu: float = _efficiency(0.6, "fraction of peak FLOP/s in linear layers")
        attention_efficiency: float = _efficiency(0.4, "fraction of peak FLOP/s in attention")
        bandwidth_efficiency: float = _efficiency(0.8, "fraction of peak memory bandwidth")
        comm_efficiency: float = _efficiency(0.7, "fraction of link bandwidth in collectives")
        step_overhead_s: float = Field(
            0.0, ge=0, description="fixed seconds per step (launches, host time), e.g. 2e-3"
        )
        host_bandwidth: float | None = Field(
            None, gt=0, description="KV offload link bytes/s per direction (default: PCIe)"
        )
        network_bandwidth: float = Field(
            DEFAULT_NETWORK_BANDWIDTH, gt=0, description="disaggregated KV bytes/s"
        )
        transfer_efficiency: float = _efficiency(
            DEFAULT_TRANSFER_EFFICIENCY, "fraction of a link's bandwidth a KV transfer gets"
        )

        @field_validator("model")
        @classmethod
        def _known_model(cls, value: str) -> str:
            if value not in MODEL_NAMES:
                raise ValueError(
                    f"model: unknown shape {value!r}; valid names: {', '.join(MODEL_NAMES)}"
                )
            return value

        @field_validator("device")
        @classmethod
        def _known_device(cls, value: str) -> str:
            if value not in DEVICE_NAMES:
                raise ValueError(
                    f"device: unknown device {value!r}; valid names: {', '.join(DEVICE_NAMES)}"
                )
            return value

        @model_validator(mode="after")
        def _one_model(self) -> RooflineCostModel.Options:
            if self.model_config_path is not None and "model" in self.model_fields_set:
                raise ValueError("set one of model and model_config_path, not both")
            return self

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, RooflineCostModel.Options)
        self.shape = _load_shape(options)
        self.device = device_spec(options.device)
        self.factors = CostFactors(
            mfu=options.mfu,
            attention_efficiency=options.attention_efficiency,
            bandwidth_efficiency=options.bandwidth_efficiency,
            comm_efficiency=options.comm_efficiency,
            step_overhead_s=options.step_overhead_s,
        )
        self.links = TransferLinks.for_device(
            self.device,
            options.host_bandwidth,
            options.network_bandwidth,
            options.transfer_efficiency,
        )

    @hookimpl
    def step_cost(self, step: StepShape) -> float | None:
        """Seconds of `step` on the configured device (`roofline_seconds`)."""
        return roofline_seconds(self.shape, self.device, step, self.factors, self.links)

    def breakdown(self, step: StepShape) -> dict[str, float]:
        """Seconds of each phase of `step` (`breakdown`), for reports."""
        return breakdown(self.shape, self.device, step, self.factors, self.links)


def _load_shape(options: RooflineCostModel.Options) -> ModelShape:
    """The options' model shape at their dtype: the named one, or the operator's config
    file's (ValueError naming `model_config_path` when it cannot be read)."""
    if options.model_config_path is None:
        return model_shape(options.model, options.dtype_bytes)
    path = Path(options.model_config_path).expanduser()
    try:
        config = json.loads(path.read_text())
        shape = ModelShape.from_hf_config(config, dtype_bytes=options.dtype_bytes)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(
            f"model_config_path: cannot read a model shape from {path}: {exc}"
        ) from exc
    return replace(shape, name=shape.name if shape.name != "custom" else path.parent.name)
