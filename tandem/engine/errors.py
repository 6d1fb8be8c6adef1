"""Errors a caller of `AsyncLLM` handles: each says what happened and what to do."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """An engine core process (or its worker) died or stopped after a failed step. Every
    request in flight fails with it; the `AsyncLLM` accepts no new work."""


class QueueFullError(RuntimeError):
    """`max_num_waiting` requests already wait beyond what the engines can run at once;
    try again after `retry_after_s` seconds (HTTP 429 with `Retry-After`)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StreamOverflowError(RuntimeError):
    """The consumer of a stream fell more than `stream_buffer_size` outputs behind; the
    request was aborted so that it does not hold KV blocks for a reader that is gone."""
