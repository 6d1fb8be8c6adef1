"""The worker's torch threads: how many (resolved once per config) and setting them."""

from __future__ import annotations

import logging
import os

from tandem.core.executor import executor_class
from tandem.core.worker.cpu_affinity import allowed_cpus, cpu_list, pin_threads
from tandem.schema.config import ConfigError, EngineConfig

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
    return max(1, len(allowed_cpus())), "the CPUs this process may use"


def resolve_worker_threads(config: EngineConfig) -> None:
    """Fill `parallel.worker_num_threads`: the explicit setting, else `OMP_NUM_THREADS`,
    else the CPUs this process may use (split evenly between the ranks of a multi-rank
    executor: the number is per rank); record where the number came from."""
    parallel = config.parallel
    if parallel.worker_num_threads is None:
        threads, source = default_worker_threads()
        if parallel.world_size > 1:  # the ranks share this host's CPUs
            threads, source = max(1, threads // parallel.world_size), f"{source} / world_size"
        parallel.worker_num_threads, parallel._threads_from = threads, source
    else:
        parallel._threads_from = "parallel.worker_num_threads"
    if parallel.cpu_bind != "none":
        try:
            cpu_list(parallel.cpu_bind, parallel.worker_num_threads)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


_announced_threads: int | None = None
_pinned: list[int] | None = None


def set_worker_threads(config: EngineConfig) -> None:
    """Give the worker its resolved torch threads (`torch.set_num_threads`), from the
    thread the worker runs on. With the `inprocess` and `thread` executors that is the
    caller's process, so the count is process-wide: it is set only when it differs from
    the current one and logged (INFO) once per distinct value. The engine never changes
    the thread count for its own sake. With `parallel.cpu_bind` other than `none` the
    threads are then pinned (once per distinct CPU list in a process)."""
    import torch

    global _announced_threads, _pinned
    if config.parallel.worker_num_threads is None:  # a config built without resolve_config
        resolve_worker_threads(config)
    threads = config.parallel.worker_num_threads
    assert threads is not None
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    cpus = cpu_list(config.parallel.cpu_bind, threads)
    if cpus is not None and cpus != _pinned and pin_threads(cpus):
        _pinned = cpus
    if _announced_threads != threads:
        _announced_threads = threads
        shared = executor_class(config.parallel.executor).runs_in_caller_process
        logger.info(
            "worker: %d torch threads (from %s)%s",
            threads,
            config.parallel.worker_threads_from,
            "; the worker runs in this process, so this is the process's thread count"
            if shared
            else "",
        )
