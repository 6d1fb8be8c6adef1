"""Grammar compilation off the hot path: a thread pool and a cache keyed by (backend,
constraint text: `compile_key`).

`submit` returns a `Future` of the compiled grammar at once; a spec compiled (or being
compiled) before shares its future, so a hundred requests with one schema compile it
once. Errors are cached with the spec (compiling it again would fail again); a time-out is
not (the next request tries again). A compile thread cannot be interrupted: a timed-out
compile keeps its worker until it returns, so the pool has a few workers and the time-out
only fails the requests waiting for it. Workers are daemon threads, so such a compile never
keeps the process from exiting (a `ThreadPoolExecutor` joins its threads at exit).
"""

from __future__ import annotations

import json
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.structured_output.backend import GrammarBackend


def compile_key(spec: StructuredOutputsParams) -> str:
    """The constraint as text, in its own key order: a schema's `properties` order is the
    order the grammar makes the model write them in, so (unlike `spec_key`) two schemas
    that differ only in that order compile separately."""
    return spec.kind + ":" + json.dumps(getattr(spec, spec.kind), separators=(",", ":"))


class CompilePool:
    """Compiles grammars in `max_workers` threads; caches up to `cache_size` results (LRU)."""

    def __init__(self, max_workers: int, cache_size: int) -> None:
        self.max_workers = max_workers
        self.cache_size = cache_size
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self.num_compiles = 0

    def submit(self, backend: GrammarBackend, spec: StructuredOutputsParams) -> Future[Any]:
        key = (backend.name, compile_key(spec))
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if len(self._workers) < self.max_workers:
            worker = threading.Thread(
                target=self._work, name=f"tandem-grammar-{len(self._workers)}", daemon=True
            )
            worker.start()
            self._workers.append(worker)
        compiled: Future[Any] = Future()
        self._jobs.put((compiled, lambda: backend.compile(spec)))
        self.num_compiles += 1
        self._cache[key] = compiled
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _work(self) -> None:
        while True:
            future, job = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # cancelled (timed out) before it started
            try:
                future.set_result(job())
            except BaseException as exc:  # reported to the request, never raised here
                future.set_exception(exc)

    def forget(self, future: Future[Any]) -> None:
        """Drop a (timed-out) future from the cache so that the spec is compiled again."""
        for key, cached in list(self._cache.items()):
            if cached is future:
                del self._cache[key]
