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
how many *other* runnable tasks the machine has: the system's runnable count
(`/proc/loadavg`, fourth field, numerator) minus the runnable threads
(`/proc/PID/task/*/stat`, state `R`) of this process and its parent. The worker's spinning
threads and the API server of `tandem serve` streaming tokens are the server's own work, not
a neighbour's (counting the API server as one took a thread away at 1 req/s: TPOT p50
111.6 ms against 56.9 with the threads kept, one run each).

The answer is `clamp(cores - others, 1, max_threads)` with `others` the fewest seen over
the last `window` samples: a neighbour that keeps a core busy all that time (about
`window * interval_s`) takes a thread away, and the thread comes back one sample after it
stops; bursts (the benchmark client parsing a stream, kernel threads, a shell) do not move
it. On a quiet 2-core machine serving 1 req/s, single samples saw 0-4 other runnable tasks
(median 1) and the fewest over 5 samples was 0 in 70 of 80; two busy neighbours count 2 in
every sample. Without `/proc` (not Linux) the count stays `max_threads`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("tandem.worker")

#: Seconds between samples, and how many samples the median covers.
INTERVAL_S = 0.5
WINDOW = 5


def _runnable_threads(pid: int | str) -> int:
    """Threads of process `pid` in state R (0 when it is gone)."""
    count = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread exited meanwhile
            continue
        end = stat.rindex(")")
        if stat[end + 2 : end + 3] == "R":
            count += 1
    return count


def _family() -> set[int]:
    """This process and its parent: under `tandem serve`, the engine core and the API server
    (whose streaming is the server's own work, not a neighbour's). Siblings are not family:
    busy loops a caller spawned beside its engine are neighbours."""
    return {os.getpid(), os.getppid()}


def runnable_others() -> int | None:
    """Runnable tasks on the machine that are not threads of this process's family
    (`_family`); None without `/proc`."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    own = sum(_runnable_threads(pid) for pid in _family())
    return max(0, running - own)


class LoadGovernor:
    """The worker's thread count under the machine's load (module docstring)."""

    def __init__(
        self,
        max_threads: int,
        cores: int,
        *,
        sample: Callable[[], int | None] = runnable_others,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = INTERVAL_S,
        window: int = WINDOW,
    ) -> None:
        if max_threads < 1 or cores < 1:
            raise ValueError(f"max_threads and cores must be >= 1, got {max_threads}, {cores}")
        self.max_threads, self.cores = max_threads, cores
        self._sample, self._clock = sample, clock
        self._interval_s = interval_s
        self._others: deque[int] = deque(maxlen=window)
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
        busy = min(self._others)
        threads = max(1, min(self.max_threads, self.cores - busy))
        if threads != self._threads:
            logger.info(
                "worker: %d torch threads (%d other runnable tasks on %d cores)",
                threads,
                busy,
                self.cores,
            )
        self._threads = threads
        return threads
