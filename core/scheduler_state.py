"""A read-only view of a scheduler's state, for invariant checks, tests and tracing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.core.request import Request

if TYPE_CHECKING:
    from tandem.kv import KVCacheManager


@dataclass(slots=True, frozen=True)
class SchedulerState:
    """What the `scheduler_state` hook returns. Callers must not mutate anything in it."""

    requests: Mapping[str, Request]
    waiting: Sequence[Request]
    running: Sequence[Request]
    kv_cache_manager: KVCacheManager
    num_steps_in_flight: int = 0
