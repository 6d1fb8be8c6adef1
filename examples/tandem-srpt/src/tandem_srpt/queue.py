"""The WAITING queue of `srpt-order`: shortest remaining work first, with aging.

The policy, for a request R waiting at scheduler step `now` (one step = one `schedule`
call, counted by `advance`):

    key(R, now) = W(R) - aging_rate * (now - s(R))

`s(R)` is the step at which R entered the engine and `W(R)` its remaining work in tokens
(`remaining_work`). The smallest key is admitted first. Every waiting request ages at the
same rate, so `key(R, now) = d(R) - aging_rate * now` with the time-invariant *virtual
deadline* `d(R) = W(R) + aging_rate * s(R)`: ordering by `key` at any step is ordering by
`d`. The queue is therefore a heap on `(d, insertion order)`, O(log n) per operation, with
no re-sorting as steps pass. `W` does not change while a request waits (its ledger moves
only while it runs), so `d` is fixed for as long as it waits.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from tandem.core.request import Request


def remaining_work(request: Request, max_model_len: int) -> int:
    """Tokens the engine still has to process for `request`, as seen from WAITING.

    `num_tokens - num_computed_tokens` is what is still to prefill: the prompt of a new
    request; prompt *and* outputs so far for a preempted one (it is recomputed). Plus the
    outputs still to decode, `max_tokens - num_output_tokens`, capped by the room left under
    `max_model_len`. The result lies in `[1, max_model_len]`; for a waiting request it equals
    `min(num_prompt_tokens + max_tokens, max_model_len)`, before and after a preemption.
    Prefix-cache hits are not subtracted (looking them up would touch the KV cache manager
    for every queued request).
    """
    to_prefill = max(request.num_tokens - request.num_computed_tokens, 0)
    to_decode = min(
        request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens
    )
    return min(max(to_prefill + max(to_decode, 0), 1), max_model_len)


class SRPTQueue:
    """WAITING ordered by the virtual deadline `remaining_work + aging_rate * s`.

    A `tandem.core.waiting_queue.WaitingQueue`. `step` counts `advance` calls (scheduler
    steps). `add` starts a request's age at the current step; `prepend` (a request put back:
    preempted, or skipped while not ready) keeps the step at which it first entered, so a
    preempted request keeps its age and normally resumes ahead of later arrivals, as under
    FCFS. The plugin calls `forget` / `forget_finished` when requests leave the engine.
    """

    def __init__(self, aging_rate: float, max_model_len: int) -> None:
        if not aging_rate > 0:
            raise ValueError(f"aging_rate: must be > 0, got {aging_rate!r}")
        self.aging_rate = aging_rate
        self.max_model_len = max_model_len
        #: Scheduler steps so far (`advance` calls).
        self.step = 0
        self._heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()
        #: Per live request: the step it entered the engine (kept across preemptions).
        self._entered: dict[str, tuple[int, Request]] = {}

    @property
    def arrival_steps(self) -> dict[str, int]:
        """The step at which each live request entered the engine."""
        return {rid: step for rid, (step, _) in self._entered.items()}

    # Policy ----------------------------------------------------------------------------
    def deadline(self, request: Request) -> float:
        """The time-invariant sort key `W + aging_rate * s` of a known request."""
        s = self._entered[request.request_id][0]
        return remaining_work(request, self.max_model_len) + self.aging_rate * s

    def key(self, request: Request, now: int | None = None) -> float:
        """The SRPT-with-aging key at step `now` (default: the current step): remaining work
        minus `aging_rate` times the steps waited since arrival. Smaller goes first."""
        now = self.step if now is None else now
        steps_waited = now - self._entered[request.request_id][0]
        return remaining_work(request, self.max_model_len) - self.aging_rate * steps_waited

    # WaitingQueue ----------------------------------------------------------------------
    def _push(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.deadline(request), next(self._order), request))

    def add(self, request: Request) -> None:
        """A new request: it ages from the current step."""
        self._entered[request.request_id] = (self.step, request)
        self._push(request)

    def prepend(self, request: Request) -> None:
        """A request put back: it keeps the age it had."""
        self._entered.setdefault(request.request_id, (self.step, request))
        self._push(request)

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def discard(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [entry for entry in self._heap if id(entry[2]) not in drop]
        heapq.heapify(self._heap)

    def advance(self, now: float) -> None:
        """One scheduler step passed (ages by steps: the wall clock `now` is not used)."""
        self.step += 1

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Queued requests in admission order (smallest key first)."""
        return (entry[2] for entry in sorted(self._heap, key=lambda e: (e[0], e[1])))

    # Requests leaving the engine -------------------------------------------------------
    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the arrival steps of requests that left the engine (aborted)."""
        for request_id in request_ids:
            self._entered.pop(request_id, None)

    def forget_finished(self, request_ids: Iterable[str]) -> None:
        """Drop the arrival steps of those of `request_ids` that finished."""
        for request_id in request_ids:
            entry = self._entered.get(request_id)
            if entry is not None and entry[1].is_finished:
                del self._entered[request_id]
