"""One request's outputs on their way to its consumer: bounded, never blocking the producer.

The output handler `put`s without waiting; the consumer awaits `get`. A consumer that falls
more than `limit` outputs behind overflows the stream: `put` returns False (the caller then
aborts the request) and the consumer gets `StreamOverflowError`. An error (`fail`) is
delivered after the outputs already queued.
"""

from __future__ import annotations

import asyncio
from collections import deque

from tandem.engine.errors import StreamOverflowError
from tandem.schema.outputs import RequestOutput


class RequestStream:
    def __init__(self, limit: int) -> None:
        self._items: deque[RequestOutput] = deque()
        self._ready = asyncio.Event()
        self._error: BaseException | None = None
        self._limit = limit
        self.closed = False

    def put(self, output: RequestOutput) -> bool:
        """Queue an output; False (and the stream fails) when the consumer is too far
        behind."""
        if self.closed:
            return True
        if len(self._items) >= self._limit:
            self.fail(
                StreamOverflowError(
                    f"the client fell {self._limit} outputs behind its stream; the request "
                    "was aborted"
                )
            )
            return False
        self._items.append(output)
        self._ready.set()
        return True

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output; raises the stream's error once the queued outputs are out."""
        while True:
            if self._items:
                return self._items.popleft()
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()
