"""Each rank measures the memory its KV pool may take; the engine takes the minimum.

The pool is planned at resolution from `cache.kv_cache_memory_gib` (per rank) or set by
`cache.num_kv_blocks`. Once every rank has loaded its weights and allocated the planned
pool, each rank reports how many blocks of its own pool its device can hold
(`Worker.kv_cache_capacity`, `fitting_blocks`):

- CUDA: `gpu_memory_utilization x total` minus everything else on the device (the
  weights, other processes; this rank's pool counts as KV), as vLLM budgets a GPU
  (activation peaks are not profiled: leave headroom in the fraction);
- CPU: `MemAvailable` (/proc/meminfo) shared evenly by the ranks on the host
  (`RankInfo.local_world_size`), 90 % of it; the pool's pages count as available, since
  an allocated pool is committed only as it is written.

`fit_kv_cache` (the engine, before the scheduler is built) takes the smallest count over
the ranks; when it is below the planned count, every rank shrinks its pool to it and
`cache.num_kv_blocks` becomes it. A pool that cannot hold one `max_model_len` request is a
`ConfigError` naming the keys to change. Executors without `collective_rpc` and models
without a resizable pool keep the planned pool.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tandem.schema.config import ConfigError, EngineConfig

logger = logging.getLogger("tandem.worker")

#: The share of the host's available memory a CPU rank's pool may take.
CPU_MEMORY_FRACTION = 0.9


def mem_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory available without swapping (None where unknown)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def fitting_blocks(
    device: torch.device,
    block_bytes: int,
    pool_bytes: int,
    local_world_size: int,
    gpu_memory_utilization: float,
) -> int | None:
    """Blocks of `block_bytes` this rank's device can hold for KV, counting its current
    pool (`pool_bytes`) as KV memory; None where the device cannot be measured."""
    if block_bytes <= 0:
        return None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        available = int(total * gpu_memory_utilization) - (total - free) + pool_bytes
    elif device.type == "cpu":
        host = mem_available_bytes()
        if host is None:
            return None
        available = int(host * CPU_MEMORY_FRACTION) // max(1, local_world_size)
    else:
        return None
    return max(0, available) // block_bytes


def fit_kv_cache(config: EngineConfig, executor: Any) -> None:
    """Shrink every rank's pool to the smallest count a rank can hold (see the module
    docstring); `config.cache.num_kv_blocks` then states the pool the ranks hold."""
    planned = config.cache.num_kv_blocks
    if planned is None:
        return
    try:
        reports = executor.collective_rpc("kv_cache_capacity")
    except NotImplementedError:
        return
    fits = [(rank, r["fits"]) for rank, r in enumerate(reports) if r and r["fits"] is not None]
    if not fits:
        return
    rank, blocks = min(fits, key=lambda item: item[1])
    if blocks >= planned:
        return
    tokens = blocks * config.cache.block_size
    if tokens < config.max_model_len:
        raise ConfigError(
            f"cache.kv_cache_memory_gib: rank {rank}'s memory holds {blocks} KV blocks "
            f"({tokens} tokens) after its weights, fewer than model.max_model_len "
            f"({config.max_model_len}); lower model.max_model_len, free memory or raise "
            "cache.gpu_memory_utilization"
        )
    logger.warning(
        "KV pool: %d blocks planned, rank %d's free memory holds %d; every rank keeps %d",
        planned,
        rank,
        blocks,
        blocks,
    )
    executor.collective_rpc("resize_kv_cache", (blocks,))
    config.cache.num_kv_blocks = blocks
