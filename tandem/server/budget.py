"""The server's process and thread budget, printed at start.

`tandem serve` runs one API-server process (one thread doing compute: the event loop),
N engine-core processes (a busy loop that sleeps when idle, and two I/O threads that wait
on sockets) and, in each, a worker with k torch threads. The compute threads,
`1 + N * k`, must fit the C cores this process may use (`os.sched_getaffinity`):
by default k = max(1, (C - 1) // N); an explicit k, or N engines, that do not fit is an
error naming the flags and the numbers. The one exception is a single engine on a single
core (1 + 1 > 1: one thread per process is the least there is); the line then says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class BudgetError(ValueError):
    """The requested threads do not fit the cores this process may use."""


@dataclass(frozen=True, slots=True)
class Budget:
    cores: int
    data_parallel_size: int
    worker_threads: int

    @property
    def compute_threads(self) -> int:
        return 1 + self.data_parallel_size * self.worker_threads

    def line(self) -> str:
        """The one line `tandem serve` prints at start."""
        n, k = self.data_parallel_size, self.worker_threads
        fits = "<=" if self.compute_threads <= self.cores else "> (one core: the least there is)"
        return (
            f"tandem serve: processes: API server 1 (1 thread), engine core x {n} (busy loop "
            f"+ 2 I/O threads, idle), worker {k} torch threads each; compute threads "
            f"1 + {n}*{k} = {self.compute_threads} {fits} {self.cores} cores this process "
            "may use"
        )


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan_budget(
    data_parallel_size: int, worker_threads: int | None, cores: int | None = None
) -> Budget:
    """k threads per worker for N engines on `cores` (default: this process's); raise
    `BudgetError` naming `--worker-threads` and `--data-parallel-size` when 1 + N*k > C."""
    cores = usable_cores() if cores is None else cores
    n = data_parallel_size
    if n < 1:
        raise BudgetError(f"--data-parallel-size: expected >= 1, got {n}")
    if worker_threads is None:
        if n > 1 and 1 + n > cores:
            raise BudgetError(
                f"--data-parallel-size {n}: 1 API thread + {n} engines x 1 torch thread = "
                f"{1 + n} compute threads exceed the {cores} cores this process may use; "
                f"use --data-parallel-size <= {max(1, cores - 1)}"
            )
        return Budget(cores, n, max(1, (cores - 1) // n))
    if worker_threads < 1:
        raise BudgetError(f"--worker-threads: expected >= 1, got {worker_threads}")
    budget = Budget(cores, n, worker_threads)
    if budget.compute_threads > cores:
        raise BudgetError(
            f"--worker-threads {worker_threads} with --data-parallel-size {n}: 1 + {n}*"
            f"{worker_threads} = {budget.compute_threads} compute threads exceed the {cores} "
            f"cores this process may use; use --worker-threads <= {max(1, (cores - 1) // n)}"
        )
    return budget
