"""Worker threads that give way to other busy processes (`parallel.yield_to_load`).

On a machine the worker shares, how many torch threads serve best depends on what else
runs. Alone, k threads on k cores with OpenMP's default short spin at barriers are fastest
(a 2-core AMD EPYC with AVX-512, SmolLM2 float32 batch 1 through `AsyncLLM`: 17.6 ms/token with 2 spinning
threads, 27.3 with 2 threads waiting passively, about 40 with 1). Beside one other busy
process, two threads lose: a thread whose partner was descheduled waits at every barrier
(10-25x slower when spinning, 1.1-1.3x slower than 1 thread when passive;
benchmarks/results/omp_wait_probe.json). So the thread count follows the load instead of
a wait policy that is wrong in one of the two cases.

`LoadGovernor.threads()` is asked before each step. At most every `interval_s` it samples
how many cores *other* processes kept busy since the previous sample (`OtherCpuLoad`): the
machine's busy CPU time (`/proc/stat`: user, nice, system, irq, softirq) minus the CPU time
of this process and its parent (`/proc/PID/stat`, utime + stime), over the elapsed time. The
worker's spinning threads and the API server of `tandem serve` streaming tokens are the
server's own work, not a neighbour's (counting the API server as one took a thread away at
1 req/s: TPOT p50 111.6 ms against 56.9 with the threads kept, one run each).

The answer is `clamp(cores - round(others), 1, max_threads)` with `others` the least seen
over the last `window` samples: a neighbour that keeps at least half a core busy all that
time (about `window * interval_s`) takes a thread away, and the thread comes back one
sample after it stops. A light neighbour does not move it: the load generator of a serving
benchmark, parsing 32 token streams on the same 2 cores, used well under half a core.

The sampler measures time, not instants. An instant count (`/proc/loadavg`'s running tasks
minus this family's threads in state R) reads two moments apart while the worker's threads
change state: in a 32-request burst through `tandem serve` on a 2-core EPYC it came out 1-2
too high in about half the samples (a scan of every other process at the same samples found
only the load generator, and only in some). The worker then dropped to 1 thread, and the
burst took 15.9-21.3 s over 4 runs, against 15.9-16.1 s with the governor off. Without `/proc` (not Linux) the count stays
`max_threads`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable

logger = logging.getLogger("tandem.worker")

#: Seconds between samples, and how many samples the median covers.
INTERVAL_S = 0.5
WINDOW = 5


#: Fields of /proc/stat's `cpu` line that are busy time: user, nice, system, irq, softirq
#: (idle, iowait and the hypervisor's steal are not a neighbour's work; guest time is
#: already inside user).
_BUSY_FIELDS = (0, 1, 2, 5, 6)


def _machine_busy_ticks() -> int | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    return sum(int(fields[1 + i]) for i in _BUSY_FIELDS)


def _process_ticks(pid: int) -> int:
    """utime + stime of process `pid`, every thread (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


def _family() -> set[int]:
    """This process and its parent: under `tandem serve`, the engine core and the API server
    (whose streaming is the server's own work, not a neighbour's). Siblings are not family:
    busy loops a caller spawned beside its engine are neighbours."""
    return {os.getpid(), os.getppid()}


class OtherCpuLoad:
    """Each call: the cores that processes outside this family (`_family`) kept busy since
    the previous call, on average. None on the first call, when no time has passed, and
    without `/proc`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: tuple[float, int, int] | None = None
        self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def __call__(self) -> float | None:
        now, busy = self._clock(), _machine_busy_ticks()
        if busy is None:
            return None
        own = sum(_process_ticks(pid) for pid in _family())
        last, self._last = self._last, (now, busy, own)
        if last is None or now <= last[0]:
            return None
        others = (busy - last[1]) - (own - last[2])
        return max(0.0, others * self._tick_s / (now - last[0]))


class LoadGovernor:
    """The worker's thread count under the machine's load (module docstring)."""

    def __init__(
        self,
        max_threads: int,
        cores: int,
        *,
        sample: Callable[[], float | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = INTERVAL_S,
        window: int = WINDOW,
    ) -> None:
        if max_threads < 1 or cores < 1:
            raise ValueError(f"max_threads and cores must be >= 1, got {max_threads}, {cores}")
        self.max_threads, self.cores = max_threads, cores
        self._sample = sample if sample is not None else OtherCpuLoad(clock)
        self._clock = clock
        self._interval_s = interval_s
        self._others: deque[float] = deque(maxlen=window)
        self._next_sample = float("-inf")
        self._threads = max_threads

    def threads(self) -> int:
        """The thread count for the next step (sampling the load when it is due)."""
        now = self._clock()
        if now < self._next_sample:
            return self._threads
        self._next_sample = now + self._interval_s
        others = self._sample()
        if others is None:
            return self._threads
        self._others.append(others)
        busy = int(min(self._others) + 0.5)  # cores taken: a neighbour's half core or more
        threads = max(1, min(self.max_threads, self.cores - busy))
        if threads != self._threads:
            logger.info(
                "worker: %d torch threads (other processes keep %d of %d cores busy)",
                threads,
                busy,
                self.cores,
            )
        self._threads = threads
        return threads
