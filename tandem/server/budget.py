"""The server's process and thread budget, printed at start.

`tandem serve` runs one API-server process (one thread doing compute: the event loop),
N engine-core processes (a busy loop that sleeps when idle, and two I/O threads that wait
on sockets) and, for each, R workers with k torch threads each (R = tensor x pipeline
parallel ranks, one process per rank; R = 1 runs the worker in the engine core), on the C
cores this process may use (`os.sched_getaffinity`). Every rank's threads count.

Defaults:
- One engine on a small machine (C <= `SMALL_MACHINE_CORES`): k = max(1, C // R). The API server and
  the engine loop share the worker's cores: they work in short bursts between tokens (a
  few per cent of one core), while a core kept for them is a quarter to a half of the
  compute, idle at low load (docs/cpu-performance.md, "Serving latency").
- Otherwise k = max(1, (C - 1) // (N * R)): one core stays with the API server (as
  vLLM-CPU keeps one for its front end), where it is a small share of the compute.

Sharing: when the API server shares the worker's cores, the engines run with
`parallel.yield_to_load` (core/worker/load_governor.py): the worker computes on k threads
while the machine is otherwise quiet and on fewer (down to 1) while other processes keep
its cores busy. OpenMP keeps its default short spin at barriers: on a quiet 2-core machine
that is 1.5x faster per token than `OMP_WAIT_POLICY=PASSIVE` (17.6 vs 27.3 ms, SmolLM2
batch 1 through `AsyncLLM`), and with one thread a descheduled partner cannot stall it.

Fit: the compute threads `1 + N * R * k` must fit C, except that one engine may share its
cores with the API server (R * k <= C, the line says so). A budget that does not fit is an
error naming the flags and the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Up to this many cores, one engine's worker gets every core by default.
SMALL_MACHINE_CORES = 4


class BudgetError(ValueError):
    """The requested threads do not fit the cores this process may use."""


@dataclass(frozen=True, slots=True)
class Budget:
    cores: int
    data_parallel_size: int
    worker_threads: int
    #: Worker processes per engine (tensor x pipeline parallel ranks).
    ranks: int = 1

    @property
    def compute_threads(self) -> int:
        return 1 + self.data_parallel_size * self.ranks * self.worker_threads

    @property
    def api_server_shares_cores(self) -> bool:
        """True when the API server runs on the worker's cores (no core is kept for it)."""
        return self.compute_threads > self.cores

    def line(self) -> str:
        """The one line `tandem serve` prints at start."""
        n, k, r = self.data_parallel_size, self.worker_threads, self.ranks
        fits = (
            f"on {self.cores} cores this process may use: the API server shares the worker's "
            "cores, and the worker gives threads back while other processes keep them busy"
            if self.api_server_shares_cores
            else f"<= {self.cores} cores this process may use"
        )
        if r == 1:
            return (
                f"tandem serve: processes: API server 1 (1 thread), engine core x {n} (busy "
                f"loop + 2 I/O threads, idle), worker {k} torch threads each; compute threads "
                f"1 + {n}*{k} = {self.compute_threads} {fits}"
            )
        return (
            f"tandem serve: processes: API server 1 (1 thread), engine core x {n} (busy loop "
            f"+ 2 I/O threads, idle), {r} rank workers per engine (tensor x pipeline "
            f"parallel), {k} torch threads each; compute threads 1 + {n}*{r}*{k} = "
            f"{self.compute_threads} {fits}"
        )


def usable_cores() -> int:
    """The cores this process may run on."""
    from tandem.core.worker.cpu_affinity import allowed_cpus

    return len(allowed_cpus())


def yield_to_load(budget: Budget) -> bool:
    """Whether the engines should give threads back while the machine is busy: when the
    API server shares the worker's cores (module docstring)."""
    return budget.api_server_shares_cores


def default_worker_threads(data_parallel_size: int, cores: int, ranks: int = 1) -> int:
    """k for N engines of R ranks on C cores when `--worker-threads` is not given (module
    docstring)."""
    if data_parallel_size == 1 and cores <= SMALL_MACHINE_CORES:
        return max(1, cores // ranks)
    return max(1, (cores - 1) // (data_parallel_size * ranks))


def plan_budget(
    data_parallel_size: int,
    worker_threads: int | None,
    cores: int | None = None,
    ranks: int = 1,
) -> Budget:
    """k threads per worker for N engines on `cores` (default: this process's); raise
    `BudgetError` naming `--worker-threads` and `--data-parallel-size` when the threads do
    not fit (module docstring)."""
    cores = usable_cores() if cores is None else cores
    n, r = data_parallel_size, ranks
    if n < 1:
        raise BudgetError(f"--data-parallel-size: expected >= 1, got {n}")
    if r > cores:
        raise BudgetError(
            f"--tensor-parallel-size x --pipeline-parallel-size = {r} rank processes exceed "
            f"the {cores} cores this process may use; use at most {cores} ranks"
        )
    if worker_threads is None:
        if n > 1 and 1 + n * r > cores:
            raise BudgetError(
                f"--data-parallel-size {n}: 1 API thread + {n} engines x {r} ranks x 1 torch "
                f"thread = {1 + n * r} compute threads exceed the {cores} cores this process "
                f"may use; use --data-parallel-size <= {max(1, (cores - 1) // r)}"
            )
        return Budget(cores, n, default_worker_threads(n, cores, r), r)
    if worker_threads < 1:
        raise BudgetError(f"--worker-threads: expected >= 1, got {worker_threads}")
    budget = Budget(cores, n, worker_threads, r)
    if n == 1 and r * worker_threads > cores:
        ranks_note = f" x {r} ranks" if r > 1 else ""
        raise BudgetError(
            f"--worker-threads {worker_threads}{ranks_note}: more torch threads than the "
            f"{cores} cores this process may use; use --worker-threads <= {cores // r}"
        )
    if n > 1 and budget.compute_threads > cores:
        raise BudgetError(
            f"--worker-threads {worker_threads} with --data-parallel-size {n}: 1 + {n}*"
            f"{r}*{worker_threads} = {budget.compute_threads} compute threads exceed the "
            f"{cores} cores this process may use; use --worker-threads <= "
            f"{max(1, (cores - 1) // (n * r))}"
        )
    return budget
