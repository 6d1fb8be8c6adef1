"""Turning a user's config into a complete one: model limits, KV pool size, async mode.

`async_scheduling`: None resolves to on unless an option is incompatible (then off, with a
log line naming it); True with an incompatible option is an error naming it. Incompatible:
an executor without async support, pipeline parallelism, a drafter plugin that declares
`aligned_drafts = False` (looked up in the stack the engine will use).
"""

from __future__ import annotations

import logging
import math
import os

from tandem.core.config import ConfigError, EngineConfig
from tandem.core.plugin_manager import find_drafter

logger = logging.getLogger("tandem.config")

SCRIPTED_DEFAULT_VOCAB = 128
SCRIPTED_DEFAULT_EOS = 1
SCRIPTED_DEFAULT_MAX_MODEL_LEN = 1024


def async_incompatibility(config: EngineConfig, executor_supports_async: bool) -> str | None:
    """The first option that rules async scheduling out, in words, or None."""
    if not executor_supports_async:
        return f"executor {config.parallel.executor!r} without async scheduling support"
    if config.parallel.pipeline_parallel_size > 1:
        return "pipeline parallelism"
    if config.speculative is not None:
        # The drafter declares it: `aligned_drafts = False` when its drafts do not continue
        # the sampled tokens, so the worker cannot keep them for the next step.
        drafter = find_drafter(config, config.source)
        if drafter is not None and not getattr(drafter[1], "aligned_drafts", True):
            return f"drafter {drafter[0]!r} (its drafts are not aligned with the sampled tokens)"
    return None


def resolve_async_scheduling(config: EngineConfig, executor_supports_async: bool) -> bool:
    incompatible = async_incompatibility(config, executor_supports_async)
    requested = config.scheduler.async_scheduling
    if requested and incompatible:
        raise ConfigError(f"scheduler.async_scheduling: true is not supported with {incompatible}")
    if requested is None:
        if incompatible:
            logger.info("async scheduling disabled: %s", incompatible)
            return False
        return True
    return requested


def default_worker_threads() -> tuple[int, str]:
    """The worker's torch threads when the config names none, and where the number came
    from: `OMP_NUM_THREADS` when it holds a positive integer (its first entry, as OpenMP
    reads a nested list), else the CPUs this process may run on."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        first = env.split(",")[0].strip()
        if first.isdigit() and int(first) >= 1:
            return int(first), "OMP_NUM_THREADS"
        logger.warning("OMP_NUM_THREADS=%r is not a positive integer; ignored", env)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS, Windows)
        cpus = os.cpu_count() or 1
    return max(1, cpus), "the CPUs this process may use"


def resolve_worker_threads(config: EngineConfig) -> None:
    """Fill `parallel.worker_num_threads`: the explicit setting, else `OMP_NUM_THREADS`,
    else the CPUs this process may use; record where the number came from."""
    parallel = config.parallel
    if parallel.worker_num_threads is None:
        parallel.worker_num_threads, parallel._threads_from = default_worker_threads()
    else:
        parallel._threads_from = "parallel.worker_num_threads"


_announced_threads: int | None = None


def set_worker_threads(config: EngineConfig) -> None:
    """Give the worker its resolved torch threads (`torch.set_num_threads`), from the
    thread the worker runs on. With the `inprocess` and `thread` executors that is the
    caller's process, so the count is process-wide: it is set only when it differs from
    the current one and logged (INFO) once per distinct value. The engine never changes
    the thread count for its own sake."""
    import torch

    global _announced_threads
    if config.parallel.worker_num_threads is None:  # a config built without resolve_config
        resolve_worker_threads(config)
    threads = config.parallel.worker_num_threads
    assert threads is not None
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if _announced_threads != threads:
        _announced_threads = threads
        shared = config.parallel.executor in ("inprocess", "thread")
        logger.info(
            "worker: %d torch threads (from %s)%s",
            threads,
            config.parallel.worker_threads_from,
            "; the worker runs in this process, so this is the process's thread count"
            if shared
            else "",
        )


def _resolve_real_model(config: EngineConfig) -> None:
    """Fill vocabulary, EOS, max_model_len and the KV pool size from the model's files."""
    import torch

    from tandem.core.worker.hf_model import kv_bytes_per_token, resolve_dtype
    from tandem.core.worker.model_files import load_hf_config, resolve_model_dir

    model = config.model
    model_dir = resolve_model_dir(model.model, allow_download=model.allow_download)
    model.model = str(model_dir)
    hf = load_hf_config(model_dir)
    model.vocab_size = hf.vocab_size
    if model.eos_token_id is None:
        eos = getattr(hf, "eos_token_id", None)
        model.eos_token_id = eos[0] if isinstance(eos, list) else eos
    if model.max_model_len is None:
        model.max_model_len = int(getattr(hf, "max_position_embeddings", 2048))
    if config.cache.num_kv_blocks is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        per_token = kv_bytes_per_token(hf, resolve_dtype(model.dtype, device))
        budget = int(config.cache.kv_cache_memory_gib * (1 << 30))
        config.cache.num_kv_blocks = max(1, budget // (per_token * config.cache.block_size))
        capacity = config.cache.num_kv_blocks * config.cache.block_size
        model.max_model_len = min(model.max_model_len, capacity)


def resolve_config(config: EngineConfig, executor_supports_async: bool = True) -> EngineConfig:
    """Return a copy with every `None` that has a computable value filled in."""
    config = config.model_copy(deep=True)
    model = config.model
    if model.model == "scripted":
        if model.vocab_size is None:
            model.vocab_size = SCRIPTED_DEFAULT_VOCAB
        if model.eos_token_id is None:
            model.eos_token_id = SCRIPTED_DEFAULT_EOS
        if model.max_model_len is None:
            model.max_model_len = SCRIPTED_DEFAULT_MAX_MODEL_LEN
    else:
        _resolve_real_model(config)
    if model.max_model_len is None:
        raise ConfigError("model.max_model_len: could not be determined; set it explicitly")
    if config.cache.num_kv_blocks is None:
        per_seq = math.ceil(model.max_model_len / config.cache.block_size)
        config.cache.num_kv_blocks = config.scheduler.max_num_seqs * per_seq
    capacity = config.cache.num_kv_blocks * config.cache.block_size
    if capacity < model.max_model_len:
        raise ConfigError(
            f"cache.num_kv_blocks: {config.cache.num_kv_blocks} blocks of "
            f"{config.cache.block_size} tokens hold {capacity} tokens, fewer than "
            f"max_model_len ({model.max_model_len}); one request could never finish"
        )
    if (
        config.speculative
        and config.speculative.prompt_lookup_min > config.speculative.prompt_lookup_max
    ):
        raise ConfigError("speculative.prompt_lookup_min must be <= speculative.prompt_lookup_max")
    config.scheduler.async_scheduling = resolve_async_scheduling(config, executor_supports_async)
    resolve_worker_threads(config)
    return config
