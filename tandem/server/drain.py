"""Graceful shutdown: requests in flight finish, or end with a proper error, never a bare 500.

On SIGTERM (or SIGINT) uvicorn stops accepting connections and waits for the responses in
flight. `Drain.begin(grace_s)` (called as the shutdown starts) gives them `grace_s`
seconds; past that it *aborts* what is left: a non-streaming request answers 503 with an
OpenAI error body (`run_cancellable(..., stop=drain)`), a stream sends one SSE error event
and `[DONE]` (`guard_stream`). Either way the handler's cancellation aborts the request in
the engine. uvicorn's own graceful timeout is set past `grace_s` (`uvicorn_grace_s`), so its
"cancel the task, answer a plain-text 500" fallback never fires first.

Invariant: `aborting` only goes from False to True, once per process; callbacks registered
after that run at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.server.errors import APIError

logger = logging.getLogger("tandem.server")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
#: Time uvicorn is given past the grace period for the aborted responses to go out.
ABORT_FLUSH_S = 5.0


def shutdown_error() -> APIError:
    """What an aborted request answers."""
    return APIError(
        503,
        "the server is shutting down and the request did not finish within the shutdown "
        "grace period (--shutdown-timeout); retry on another server",
        err_type="ServiceUnavailableError",
    )


def uvicorn_grace_s(grace_s: float) -> float:
    """uvicorn's `timeout_graceful_shutdown` for a drain of `grace_s` seconds."""
    return grace_s + ABORT_FLUSH_S


class Drain:
    """The shutdown state shared by every handler of one app."""

    def __init__(self) -> None:
        self.aborting = False
        self._callbacks: set[Callable[[], None]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def begin(self, grace_s: float) -> None:
        """The server started shutting down: abort what is in flight after `grace_s`."""
        if self._timer is None and not self.aborting:
            logger.info("shutting down: waiting up to %.1f s for requests in flight", grace_s)
            self._timer = asyncio.get_running_loop().call_later(grace_s, self.abort_all)

    def abort_all(self) -> None:
        """End every request in flight with `shutdown_error()` (and all later ones)."""
        if self.aborting:
            return
        self.aborting = True
        callbacks, self._callbacks = list(self._callbacks), set()
        if callbacks:
            logger.warning("shutdown grace period over: aborting %d request(s)", len(callbacks))
        for callback in callbacks:
            callback()

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when requests are aborted (at once if they already are);
        returns the function that unsubscribes it."""
        if self.aborting:
            callback()
            return lambda: None
        self._callbacks.add(callback)
        return lambda: self._callbacks.discard(callback)

    def waiter(self) -> asyncio.Future[None]:
        """A future done when requests are aborted."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def done() -> None:
            if not future.done():
                future.set_result(None)

        unsubscribe = self.subscribe(done)
        future.add_done_callback(lambda _: unsubscribe())
        return future


async def guard_stream(chunks: AsyncIterator[str], drain: Drain) -> AsyncIterator[str]:
    """`chunks` until the drain aborts; then it raises `shutdown_error()` (which the SSE
    framing sends as an error event before `[DONE]`). The abort cancels the task only
    while it waits for the next chunk, never while it writes one out."""
    task = asyncio.current_task()
    assert task is not None
    waiting = False
    cancelled_by_us = False

    def on_abort() -> None:
        nonlocal cancelled_by_us
        if waiting and not cancelled_by_us:
            cancelled_by_us = True
            task.cancel()

    unsubscribe = drain.subscribe(on_abort)
    iterator = chunks.__aiter__()
    try:
        while True:
            if drain.aborting:
                raise shutdown_error()
            waiting = True
            try:
                chunk = await iterator.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if cancelled_by_us and task.uncancel() == 0:
                    raise shutdown_error() from None
                raise
            finally:
                waiting = False
            yield chunk
    finally:
        unsubscribe()
        aclose: Any = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
