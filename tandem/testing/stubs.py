"""Small stand-ins for tests of one component: a request for the KV cache manager, and a
future that runs a callback when the engine collects it (to model late device work)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVRequestStub:
    """The minimal object `KVCacheManager` needs (the `tandem.kv.KVRequest` protocol)."""

    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class CollectFuture(Future):
    """A resolved copy of `inner` whose first `result()` calls `on_collect` before answering."""

    def __init__(self, inner: Future, on_collect: Callable[[], None]) -> None:
        super().__init__()
        self._on_collect: Callable[[], None] | None = on_collect
        try:
            self.set_result(inner.result())
        except BaseException as exc:  # surfaced through result()
            self.set_exception(exc)

    def result(self, timeout: float | None = None) -> Any:
        if self._on_collect is not None:
            on_collect, self._on_collect = self._on_collect, None
            on_collect()
        return super().result(timeout)
