"""Grammar compiles as events on a virtual clock (`tandem simulate`), not threads.

On a `VirtualClock` the structured-output plugin swaps its `CompilePool` for a
`VirtualCompilePool` (in `tandem_stack_loaded`, where it first sees the engine's clock).
`submit` compiles at once, in the caller's thread, and measures the compile's wall time:
the real backend's real cost on this CPU, times `scale` (0: compiles take no time). The
pool's `max_workers` threads become `max_workers` servers of a FIFO queue on the virtual
clock: a compile starts when a server is free, `ready_at = max(now, earliest free server)
+ compile_s`, and holds that server until `ready_at`. A spec compiled before (same backend
and `compile_key`, within `cache_size`, LRU) shares that compile's future: it is ready when
that compile is, at no further cost. A compile error is the future's exception, reported
at `ready_at` as the thread pool would report it; errors are cached with the spec, a
time-out is not (`forget`).

The futures (`VirtualCompile`) hold their result from the start; `done()` answers on the
virtual clock (`clock.now() >= ready_at`), which is all the plugin's drain point asks. So
the plugin's code is the same on both clocks: a request stays in `requests_not_ready` until
the first drain point at or after its `ready_at`, and `compile_timeout_s` counts virtual
seconds. `concurrent.futures.wait` reads the finished state, so `wait_for_work` never
blocks. The driver learns when to move the clock from `next_compile_event`, the plugin's
answer to `next_event_time`.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.core.clock import Clock, VirtualClock
from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.structured_output.backend import GrammarBackend
from tandem.structured_output.compile_pool import compile_key


def is_virtual(clock: Clock) -> bool:
    """Whether `clock` is simulated time (compiles then become events on it)."""
    return isinstance(clock, VirtualClock)


@dataclass(frozen=True, slots=True)
class CompileRecord:
    """One compile on the virtual clock: submitted at `submitted_s`, started when a server
    was free (`start_s`), `compile_s` long (measured x scale), ready at `ready_at`."""

    backend: str
    key: str
    submitted_s: float
    start_s: float
    compile_s: float
    ready_at: float
    failed: bool


class VirtualCompile(Future):
    """A compile that has run already; done on the virtual clock at `ready_at`."""

    def __init__(self, clock: Clock, record: CompileRecord) -> None:
        super().__init__()
        self.clock, self.record = clock, record
        self.ready_at = record.ready_at

    def done(self) -> bool:
        """True once the virtual clock reached `ready_at` (the value is held from the
        start: `result()` and `exception()` never block)."""
        return self.clock.now() >= self.ready_at


class VirtualCompilePool:
    """`CompilePool`'s interface (`submit`, `forget`, `num_compiles`, `max_workers`,
    `cache_size`) as a queue of `max_workers` servers on `clock`; see the module docstring.
    `records` lists every compile, in submission order (cache hits add none)."""

    def __init__(self, clock: Clock, max_workers: int, cache_size: int, scale: float) -> None:
        if max_workers < 1 or cache_size < 1 or not 0 <= scale < math.inf:
            raise ValueError(
                "virtual compile pool: need max_workers >= 1, cache_size >= 1 and a finite "
                f"scale >= 0, got {max_workers}, {cache_size}, {scale}"
            )
        self.clock = clock
        self.max_workers, self.cache_size, self.scale = max_workers, cache_size, scale
        self._free_at = [clock.now()] * max_workers  # a heap: when each server is free
        self._cache: OrderedDict[tuple[str, str], VirtualCompile] = OrderedDict()
        self.num_compiles = 0
        self.records: list[CompileRecord] = []

    def submit(self, backend: GrammarBackend, spec: StructuredOutputsParams) -> VirtualCompile:
        """The compile of `spec` by `backend`: the cached one, else a new one run now."""
        key = (backend.name, compile_key(spec))
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        value: Any = None
        error: Exception | None = None
        started = time.perf_counter()
        try:
            value = backend.compile(spec)
        except Exception as exc:  # reported to the request at ready_at, never raised here
            error = exc
        compile_s = (time.perf_counter() - started) * self.scale
        now = self.clock.now()
        start = max(now, heapq.heappop(self._free_at))
        record = CompileRecord(
            backend.name, key[1], now, start, compile_s, start + compile_s, error is not None
        )
        heapq.heappush(self._free_at, record.ready_at)
        future = VirtualCompile(self.clock, record)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
        self.num_compiles += 1
        self.records.append(record)
        self._cache[key] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    def forget(self, future: Future[Any]) -> None:
        """Drop a (timed-out) compile from the cache: the spec is compiled again next time.
        Its server stays busy until its `ready_at` (a compile cannot be interrupted)."""
        for key, cached in list(self._cache.items()):
            if cached is future:
                del self._cache[key]


class _Compiling(Protocol):
    """What `next_compile_event` reads of a request waiting for its grammar."""

    future: Future[Any]
    submitted: float


def timeout_instant(submitted: float, timeout_s: float) -> float:
    """The first float time t with `t - submitted > timeout_s` (the plugin's time-out test)."""
    t = submitted + timeout_s
    while not t - submitted > timeout_s:
        t = math.nextafter(t, math.inf)
    return t


def next_compile_event(states: Iterable[_Compiling], timeout_s: float) -> float | None:
    """When the first of `states` becomes ready or times out on the virtual clock (None:
    none is a `VirtualCompile`)."""
    times = [
        min(state.future.ready_at, timeout_instant(state.submitted, timeout_s))
        for state in states
        if isinstance(state.future, VirtualCompile)
    ]
    return min(times, default=None)
