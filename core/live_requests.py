"""The engine's live requests: which ids are live, the aborts queue, and ending requests.

A request is live from `admit` until it ends. It ends when the scheduler reports it finished
(`discard`) or through `end`: the plugins drop it (`abort_requests`: the scheduler frees its
KV through the fence and skips its results in flight) and the client gets its last output,
with no new token and the status's finish reason.

Aborts: `queue_aborts` (any thread) keeps aborts of the ids live at that moment: an abort
targets the request holding the id when it is called, so an id never added or already
finished is ignored. `drain_aborts` (the engine thread) ends the queued ids still live, each
once, then the requests plugins ended on their own (`poll_finished_requests`). `admit` drops
aborts still queued for its id: they were meant for an earlier request with that id, which
finished before they were drained, and must never end the new one.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from tandem.core.outputs import EngineCoreOutput
from tandem.core.request import RequestStatus


class LiveRequests:
    def __init__(self, hook: Any) -> None:
        self.hook = hook  # the engine's hook relay
        self._ids: set[str] = set()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def admit(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._aborts:
                self._aborts = deque(rid for rid in self._aborts if rid != request_id)
            self._ids.add(request_id)

    def discard(self, request_ids: Iterable[str]) -> None:
        self._ids.difference_update(request_ids)

    def queue_aborts(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self._aborts.extend(rid for rid in request_ids if rid in self._ids)

    def has_aborts(self) -> bool:
        return bool(self._aborts)

    def end(
        self, ids: list[str], status: RequestStatus, errors: Mapping[str, str | None] | None = None
    ) -> list[EngineCoreOutput]:
        """End the live requests among `ids` with `status`; `errors`: id -> reason."""
        ids = [rid for rid in ids if rid in self._ids]
        if ids:
            self.hook.abort_requests(request_ids=ids, status=status)
            self.discard(ids)
        reason, errors = status.finish_reason or "error", errors or {}
        return [EngineCoreOutput.ended(rid, reason, errors.get(rid)) for rid in ids]

    def drain_aborts(self) -> list[EngineCoreOutput]:
        """End the queued aborts, then the requests plugins ended (`poll_finished_requests`)."""
        with self._lock:
            ids = list(dict.fromkeys(rid for rid in self._aborts if rid in self._ids))
            self._aborts.clear()
        outputs = self.end(ids, RequestStatus.FINISHED_ABORTED)
        for finish in (f for found in self.hook.poll_finished_requests() for f in found or ()):
            error = finish.finish_reason == "error"
            status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_STOPPED
            outputs += self.end([finish.request_id], status, {finish.request_id: finish.error})
        return outputs

    def clear(self) -> list[str]:
        """Forget every live request and queued abort; return the ids that were live, sorted."""
        with self._lock:
            live, self._ids = sorted(self._ids), set()
            self._aborts.clear()
        return live
