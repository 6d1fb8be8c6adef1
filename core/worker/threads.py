"""The worker's torch threads: how many (resolved once per config) and setting them."""

from __future__ import annotations

import logging
import os

from tandem.config import EngineConfig

logger = logging.getLogger("tandem.config")


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
