"""The WAITING queue protocol: the order in which a scheduler admits waiting requests.

A scheduler holds its WAITING requests in an object of this shape; a policy plugin supplies
one through the `make_waiting_queue` hook (the reference scheduler falls back to its own
FCFS and priority queues, `tandem.plugins.request_queue`). The scheduler only calls the
methods below, on the engine thread.

Contract:
- `peek`/`pop` give the request to admit next; iteration yields every queued request in
  that same admission order (used for state views, not on the hot path).
- `add` enqueues a request that has never been queued. `prepend` puts back a request that
  was queued before: one preempted by recompute, or one the scheduler popped and skipped
  this step (it was not ready: `requests_not_ready`); the scheduler puts skipped requests
  back in reverse pop order, so a queue that puts `prepend`ed requests at the front keeps
  their order. A queue ordered by a key keeps the request's key (its age).
- `discard` removes requests that left the engine while waiting (aborted); requests not
  in the queue are ignored.
- `advance(now)` is called once at the start of every `schedule`, before any other call of
  that step, with the engine clock's `now()` (the clock of `Request.arrival_time`): an aging or
  fairness policy re-keys here. Each call is one scheduler step, so a policy that ages
  by steps counts the calls.
- `peek` and `pop` are only called on a non-empty queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

from tandem.core.request import Request


@runtime_checkable
class WaitingQueue(Protocol):
    """WAITING in admission order (see the module docstring for the contract)."""

    def add(self, request: Request) -> None: ...

    def prepend(self, request: Request) -> None: ...

    def peek(self) -> Request: ...

    def pop(self) -> Request: ...

    def discard(self, requests: Iterable[Request]) -> None: ...

    def advance(self, now: float) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...
