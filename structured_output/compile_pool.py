"""Grammar compilation off the hot path: a thread pool and a cache keyed by (backend, spec).

`submit` returns a `Future` of the compiled grammar at once; a spec compiled (or being
compiled) before shares its future, so a hundred requests with one schema compile it
once. Errors are cached with the spec (compiling it again would fail again); a time-out is
not (the next request tries again). A compile thread cannot be interrupted: a timed-out
compile keeps its worker until it returns, so the pool has a few workers and the time-out
only fails the requests waiting for it.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tandem.core.structured_outputs import StructuredOutputsParams
from tandem.structured_output.backend import GrammarBackend


class CompilePool:
    """Compiles grammars in `max_workers` threads; caches up to `cache_size` results (LRU)."""

    def __init__(self, max_workers: int, cache_size: int) -> None:
        self.max_workers = max_workers
        self.cache_size = cache_size
        self._executor: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self.num_compiles = 0

    def submit(self, backend: GrammarBackend, spec: StructuredOutputsParams) -> Future[Any]:
        key = (backend.name, spec.spec_key())
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.max_workers, thread_name_prefix="tandem-grammar"
            )
        future = self._executor.submit(backend.compile, spec)
        self.num_compiles += 1
        self._cache[key] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    def forget(self, future: Future[Any]) -> None:
        """Drop a (timed-out) future from the cache so that the spec is compiled again."""
        for key, cached in list(self._cache.items()):
            if cached is future:
                del self._cache[key]

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
