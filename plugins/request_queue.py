"""The reference scheduler's WAITING queues (`tandem.core.waiting_queue.WaitingQueue`):
first-come-first-served, and priority (lower value first, then arrival)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from tandem.core.request import Request


class FCFSQueue:
    """Arrival order; a request put back (`prepend`) goes to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def discard(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in drop)

    def advance(self, now: float) -> None:
        """Arrival order does not change with time."""

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class KeyedQueue:
    """Ordered by `key(request)` (computed once, at `add`), ties by insertion; a request
    put back keeps its key. Subclass it and override `key` for another fixed order."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, Request]] = []
        self._tiebreak = itertools.count()

    def key(self, request: Request) -> tuple:
        return (request.arrival_time,)

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.key(request), next(self._tiebreak), request))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def discard(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[2]) not in drop]
        heapq.heapify(self._heap)

    def advance(self, now: float) -> None:
        """Keys are fixed at arrival."""

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in sorted(self._heap, key=lambda e: e[:2]))


class PriorityQueue(KeyedQueue):
    """Ordered by (priority, arrival_time); a request put back keeps its key, so a
    preempted request comes back ahead of every later arrival of the same priority."""

    def key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    """The queue for `scheduler.scheduling_policy`."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduler.scheduling_policy: expected 'fcfs' or 'priority', got {policy!r}")
