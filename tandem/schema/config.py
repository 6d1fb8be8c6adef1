"""Engine configuration: the pydantic models of every section and of the plugin stack.

Reading YAML stack files and keyword overrides is the front door's (`tandem.stack_file`,
`tandem.load_config`). Plugin names are not listed here: `speculative.method` and
`structured_output.backend` are plain strings, checked when the stack is resolved against
what installed plugins declare (`tandem.config_resolution`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_serializer,
    field_validator,
    model_validator,
)

from tandem.schema.diffusion_config import DiffusionConfig


class ConfigError(ValueError):
    """A configuration problem; the message names the source, the key path and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Which model runs. `model` is `default` (the embedded SmolLM2), a local HF directory,
    a `.gguf` file, a Hugging Face hub id (`org/name`, read from the local hub cache;
    downloaded only with `allow_download`), or a kind a model loader declares by name
    (`scripted`: the test kit's deterministic model; `core/worker/model_loader.py`)."""

    model: str = "default"
    tokenizer: str | None = None
    allow_download: bool = Field(
        False,
        description="a Hugging Face hub id missing from the local hub cache is downloaded "
        "(otherwise only the cache is read: nothing downloads by default)",
    )
    generation_config: str = Field(
        "auto",
        description="default sampling parameters (vLLM's): auto = the model's "
        "generation_config.json, vllm = none (SamplingParams' own defaults), or a directory "
        "holding a generation_config.json",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the model runs: auto = cuda when torch sees a GPU, else cpu"
    )
    attention: Literal["auto", "torch"] = Field(
        "auto",
        description="auto: float32 decode attention on CPU uses the compiled kernel when a "
        "C++ compiler is present; torch: SDPA over gathered contexts everywhere",
    )
    f32_linear: Literal["auto", "panel", "dual", "onednn"] = Field(
        "auto",
        description="float32 linears on CPU: panel = one copy in the panel kernel's layout "
        "(fastest at decode row counts); dual = also a oneDNN-packed copy for products over "
        "16 rows (prefill, large batches; twice the layers' weight memory); onednn = oneDNN "
        "only; auto = dual on CPUs with AVX-512 for models whose checkpoint is at most 2 GiB, "
        "else panel (docs/cpu-performance.md)",
    )
    quantization: Literal["auto", "none", "int8", "int4", "awq", "gptq"] = Field(
        "auto",
        description="weight-only quantized linears on CPU (float32 activations): auto = a "
        "GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K weights and an AWQ / GPTQ checkpoint's int4 layers "
        "stay quantized, any other checkpoint runs in `dtype`; none = every weight dequantized to "
        "`dtype`; int8 / int4 = quantized at load in groups of quantization_group_size inputs; "
        "awq / gptq = the checkpoint's quantization_config must name that method "
        "(docs/quantization.md)",
    )
    quantization_group_size: Literal[0, 32, 64, 128] = Field(
        32,
        description="inputs per scale of `quantization: int8 | int4`; 0 = one scale per "
        "output channel (int8 only: symmetric, vLLM's per-channel W8)",
    )
    seed: int = 0
    max_model_len: int | None = Field(None, ge=2)
    max_logprobs: int = Field(
        20, ge=0, description="largest logprobs / prompt_logprobs a request may ask (vLLM's)"
    )
    vocab_size: int | None = Field(None, ge=2, description="default: the model loader's")
    eos_token_id: int | None = Field(None, ge=0, description="default: the model loader's")


class SchedulerConfig(_Section):
    """Token and sequence budgets and policy, with vLLM's names."""

    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    long_prefill_token_threshold: int = Field(0, ge=0, description="0 disables")
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    async_scheduling: bool | None = None
    decode_stagger: int | None = Field(
        None,
        ge=1,
        description="async scheduling: steps between two decodes of one request (the "
        "specification's PP microbatching rule); null: pipeline_parallel_size",
    )


class CacheConfig(_Section):
    """Paged KV cache shape."""

    block_size: int = Field(16, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1, description="explicit pool size")
    enable_prefix_caching: bool = True
    kv_cache_memory_gib: float = Field(
        4.0,
        gt=0,
        description="KV pool size per rank when num_kv_blocks is not given (real models; "
        "with ranks each holds its KV heads of its stage's layers, so the pool grows with "
        "tensor_parallel_size x pipeline_parallel_size; vLLM-CPU's default KV space is also "
        "4 GiB per rank)",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="on CUDA, the share of each GPU's memory the rank may fill (weights, "
        "other processes and its KV pool; as vLLM's): a planned pool larger than what is "
        "left is shrunk at start",
    )


class SpeculativeConfig(_Section):
    """Speculative decoding, as vLLM's `speculative_config`."""

    method: str = Field(
        description="the drafter: a name an installed drafter plugin declares in its "
        "`speculative_methods` (bundled: ngram, eagle, draft_model)"
    )
    num_speculative_tokens: int = Field(ge=1)
    prompt_lookup_min: int = Field(1, ge=1)
    prompt_lookup_max: int = Field(3, ge=1)
    model: str | None = None
    disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        description="no drafts are scheduled in a step while more than this many requests "
        "are running (where a step is compute-bound, verifying 1 + k tokens per request "
        "costs more than acceptance gains); None: always speculate",
    )


class KVTransferConfig(_Section):
    """vLLM's `kv_transfer_config`: the stack gets the KV-connector plugin `kv_connector`
    names (vLLM's class name where tandem bundles an equivalent, e.g. `OffloadingConnector`
    for `kv-offload`, or any installed connector plugin's name or `module:Class`), with
    `kv_connector_extra_config` as its options."""

    kv_connector: str
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] = "kv_both"
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)


class StructuredOutputConfig(_Section):
    backend: str = Field(
        "auto",
        description="auto (the stack's grammar plugin chooses) or a backend name a grammar "
        "plugin declares in its `grammar_backends` (bundled: xgrammar, outlines)",
    )


class SimulatedDeviceConfig(_Section):
    """Cost model of the simulated device (defaults: an 8B bf16 model on an H100-class GPU).

    A step takes max(FLOPs / flops_per_s, bytes / bytes_per_s): weights are read once per
    step, each scheduled request's context KV once, every scheduled token costs
    `flops_per_token`.
    """

    weight_bytes: float = Field(16.06e9, gt=0)
    kv_bytes_per_token: float = Field(131_072, ge=0)
    bytes_per_s: float = Field(3.84e12, gt=0)
    flops_per_s: float = Field(594e12, gt=0)
    flops_per_token: float = Field(2 * 8.03e9, ge=0)


class ParallelConfig(_Section):
    """Where the model runs: the executor (by its name in the entry-point group
    `tandem.executors`, or a `module:Class` path) and the ranks. `tensor_parallel_size`
    splits every layer across that many ranks (one process each, `mp` executor);
    `pipeline_parallel_size` runs the layers as that many consecutive stages (sampling on
    the last). `world_size` = tp x pp.

    `worker_num_threads`: the worker's torch (intra-op) threads. None resolves (in
    `resolve_config`) to `OMP_NUM_THREADS` when set, else the CPUs this process may run on
    (`os.sched_getaffinity`). With the `inprocess` and `thread` executors the worker lives
    in the caller's process, so this is the whole process's torch thread count.
    `cpu_bind` pins those threads (`core/worker/cpu_affinity.py`; docs/cpu-threads.md).
    `yield_to_load` lets the count drop while other processes load the machine (at most
    `worker_num_threads`; not with `cpu_bind`, whose CPU list fixes the count).
    """

    executor: str = Field(
        "inprocess",
        description="where the worker runs: an installed executor's name (inprocess, thread, "
        "process, simulated, mp, ray) or a 'module:Class' path; with tensor_parallel_size > 1 and "
        "no executor named, mp",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks each layer is split across (heads, columns, vocabulary)"
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="pipeline stages: the layers split into that many consecutive runs"
    )
    pp_layer_partition: list[int] | None = Field(
        None, description="layers per pipeline stage (vLLM's VLLM_PP_LAYER_PARTITION); null: even"
    )
    ray_address: str | None = Field(
        None,
        description="the Ray cluster the 'ray' executor joins (e.g. 'HEAD_IP:6379'); null: "
        "RAY_ADDRESS if set, else a single-node cluster on 127.0.0.1 started for this engine",
    )
    worker_num_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of the worker; null: OMP_NUM_THREADS if set, else the "
        "CPUs this process may use",
    )
    cpu_bind: str = Field(
        "none",
        description="pin the worker's threads to CPUs: 'none', 'auto' (one CPU each, the "
        "last ones this process may use) or a CPU list like '0-3,8'",
    )
    yield_to_load: bool = Field(
        False,
        description="run the worker on fewer threads (down to 1) while other processes keep "
        "this machine's cores busy, and on worker_num_threads again when they stop "
        "(core/worker/load_governor.py; tandem serve turns it on when its API server shares "
        "the worker's cores)",
    )
    simulated_device: SimulatedDeviceConfig = Field(default_factory=SimulatedDeviceConfig)
    #: Where the resolved `worker_num_threads` came from, in words (set by `resolve_config`).
    _threads_from: str = PrivateAttr(default="parallel.worker_num_threads")

    @property
    def worker_threads_from(self) -> str:
        return self._threads_from

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class PluginSpec(_Section):
    """One entry of the stack: `name` is an installed plugin's entry-point name (group
    `tandem.plugins`), a name registered in-process (`tandem.plugin_discovery.register_plugin`), or
    an import path `module:Class`; `plugin` is the class itself when one was given (e.g.
    `LLM(plugins=[MyScheduler])`; it never leaves the process: serialised, it is the path).
    """

    name: str
    options: dict[str, Any] = Field(default_factory=dict)
    plugin: Any = Field(None, repr=False)

    @field_serializer("plugin", when_used="json")
    def _plugin_as_path(self, plugin: Any) -> str | None:
        return class_path(plugin) if isinstance(plugin, type) else plugin


def class_path(cls: type) -> str:
    """`module:Qualname`, the path a class is imported by in another process."""
    return f"{cls.__module__}:{cls.__qualname__}"


def _as_spec(entry: Any) -> Any:
    """A stack entry as `PluginSpec` data: a name, a class, a `(name or class, options)`
    pair, or a mapping (whose `name` may be a class)."""
    if isinstance(entry, tuple) and len(entry) == 2:
        return {**_as_spec(entry[0]), "options": entry[1]}
    if isinstance(entry, type):
        return {"name": class_path(entry), "plugin": entry}
    if isinstance(entry, dict) and isinstance(entry.get("name"), type):
        return {**entry, **_as_spec(entry["name"])}
    return {"name": entry} if isinstance(entry, str) else entry


class EngineConfig(_Section):
    """The whole configuration. `plugins=None` means the default stack.

    `resolved_stack` is written when the stack is resolved (`tandem.config_resolution`): every
    plugin in call order with its class (serialised as `module:Class`), so a worker in
    another process rebuilds the same stack without discovery. Anything set there by hand
    is replaced by `resolve_config`.
    """

    model: ModelConfig = Field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    speculative: SpeculativeConfig | None = None
    #: Block-diffusion models (issue 15; `tandem.schema.diffusion_config`); vLLM's key
    #: `diffusion_config` is accepted as the same section.
    diffusion: DiffusionConfig | None = None
    #: KV connector (issue 26); vLLM's key `kv_transfer_config` is accepted as the same.
    kv_transfer: KVTransferConfig | None = None
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    plugins: list[PluginSpec] | None = None
    resolved_stack: list[PluginSpec] | None = None
    #: Cross-cutting plugins (`module:Class`) whose `attached_by` flag this config sets;
    #: written by `resolve_config`, attached by every engine.
    attached_plugins: list[str] = Field(default_factory=list)
    check_invariants: bool = False
    trace_hooks: bool = Field(
        False, description="time each plugin's implementation of each hook (engine side)"
    )
    #: Where the config came from (a stack file's path), for error messages.
    _source: str = PrivateAttr(default="<config>")
    #: Line (1-based) of each key path of the stack file, e.g. `("plugins", 1)`.
    _lines: dict[tuple[str | int, ...], int] = PrivateAttr(default_factory=dict)

    @property
    def source(self) -> str:
        return self._source

    #: The resolved stack object (`resolve.ResolvedStack`), kept for this process.
    _stack: Any = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _diffusion_config_alias(cls, data: Any) -> Any:
        """vLLM's `diffusion_config` is the `diffusion` section (issue 15, additive)."""
        if isinstance(data, dict) and "diffusion_config" in data:
            data = dict(data)
            if "diffusion" in data:
                raise ValueError("diffusion_config: give either diffusion or diffusion_config")
            data["diffusion"] = data.pop("diffusion_config")
        return data

    @field_validator("plugins", "resolved_stack", mode="before")
    @classmethod
    def _entries_as_specs(cls, value: Any) -> Any:
        return [_as_spec(v) for v in value] if isinstance(value, (list, tuple)) else value

    @property
    def max_model_len(self) -> int:
        if self.model.max_model_len is None:
            raise ConfigError("model.max_model_len is not resolved yet")
        return self.model.max_model_len

    @property
    def num_spec_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @property
    def max_concurrent_batches(self) -> int:
        """The batch queue's depth (the specification's V2-runner rule): pp_size + 1 under
        async scheduling (one step per stage executing while the next is planned), else
        pp_size."""
        pp = self.parallel.pipeline_parallel_size
        return pp + 1 if self.scheduler.async_scheduling else pp


def with_line(
    source: str, lines: dict[tuple[str | int, ...], int], path: tuple[str | int, ...]
) -> str:
    """`source:N` for the line of the deepest prefix of `path` the stack file has (the
    compiler convention `file:line: message`), else `source`."""
    for end in range(len(path), 0, -1):
        line = lines.get(tuple(path[:end]))
        if line is not None:
            return f"{source}:{line}"
    return source
