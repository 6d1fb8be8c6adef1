"""Pinning the worker's OpenMP threads to CPUs (`parallel.cpu_bind`), as vLLM-CPU's
`VLLM_CPU_OMP_THREADS_BIND` does.

`cpu_bind` is `"none"` (the OS places threads), `"auto"` (the last `worker_num_threads`
CPUs this process may use, one thread each: with fewer threads than CPUs the first ones
stay free for the engine, the front end and the OS), or an explicit list such as
`"0-3,8"` with exactly `worker_num_threads` CPUs. `cpu_list` resolves it; `pin_threads`
applies it through `csrc/omp_affinity.cpp`, from the thread the worker runs on (with the
`inprocess` and `thread` executors the caller's thread is OpenMP's thread 0 and is pinned
to the first CPU of the list).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess

from tandem.core.worker.native_build import CSRC, build_library

logger = logging.getLogger("tandem.worker")


def parse_cpu_list(text: str) -> list[int]:
    """`"0-3,8"` -> `[0, 1, 2, 3, 8]`; raises ValueError naming what was expected."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(
                f"parallel.cpu_bind: expected 'none', 'auto' or a CPU list like '0-3,8', "
                f"got {text!r}"
            )
        cpus.extend(range(int(lo), int(hi if sep else lo) + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"parallel.cpu_bind: CPU list {text!r} names a CPU twice")
    return cpus


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS, Windows)
        return list(range(os.cpu_count() or 1))


def cpu_list(cpu_bind: str, threads: int) -> list[int] | None:
    """The CPU of each worker thread under `cpu_bind`, or None for `"none"`."""
    if cpu_bind == "none":
        return None
    if cpu_bind == "auto":
        cpus = allowed_cpus()
        if threads > len(cpus):
            raise ValueError(
                f"parallel.cpu_bind: 'auto' needs one CPU per worker thread; "
                f"{threads} threads, {len(cpus)} CPUs"
            )
        return cpus[len(cpus) - threads :]
    cpus = parse_cpu_list(cpu_bind)
    if len(cpus) != threads:
        raise ValueError(
            f"parallel.cpu_bind: expected {threads} CPUs (one per worker thread), "
            f"got {len(cpus)} in {cpu_bind!r}"
        )
    return cpus


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        return None
    try:
        library = ctypes.CDLL(str(build_library(CSRC / "omp_affinity.cpp", compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("cannot build the thread pinning helper: %s", exc)
        return None
    library.tandem_pin_omp_threads.argtypes = [ctypes.c_void_p, ctypes.c_int]
    library.tandem_pin_omp_threads.restype = ctypes.c_int
    library.tandem_omp_thread_cpus.argtypes = [ctypes.c_void_p, ctypes.c_int]
    library.tandem_omp_thread_cpus.restype = None
    return library


def pin_threads(cpus: list[int]) -> bool:
    """Pin OpenMP thread i (of a team of `len(cpus)`) to `cpus[i]`; False (logged) when it
    could not be done: no compiler, or a CPU this process may not use."""
    library = _library()
    if library is None:
        logger.warning("parallel.cpu_bind ignored: no C++ compiler for the pinning helper")
        return False
    array = (ctypes.c_int * len(cpus))(*cpus)
    failures = library.tandem_pin_omp_threads(ctypes.addressof(array), len(cpus))
    if failures:
        logger.warning("parallel.cpu_bind: %d of %d threads not pinned", failures, len(cpus))
        return False
    logger.info("worker threads pinned to CPUs %s", cpus)
    return True


def thread_cpus(threads: int) -> list[int]:
    """The CPU each thread of a team of `threads` is on now (for checks)."""
    library = _library()
    if library is None:
        return []
    array = (ctypes.c_int * threads)()
    library.tandem_omp_thread_cpus(ctypes.addressof(array), threads)
    return list(array)
