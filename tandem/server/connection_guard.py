"""Connections that send nothing, dribble their headers, or arrive by the thousand.

uvicorn arms its keep-alive timer only after a response; a connection that never completes
its first request's headers (a slowloris client, an idle socket from a flood) is kept
forever, and each one holds a file descriptor until the process runs out and cannot accept
the next client. `guarded_protocol(config_http, guard)` returns uvicorn's HTTP protocol
class (httptools, or h11 without it) extended with two rules:

- **Header deadline.** From the moment a connection opens, and again from the moment a
  response completes on a kept-alive connection, the next request's headers must be
  complete within `header_timeout_s`, however the bytes trickle in; otherwise the
  connection is closed. Bodies have their own deadline (`api_server._read_body`).
- **Connection cap.** At most `max_connections` connections are open. A connection past
  the cap closes the one that has waited longest for a request (an idle connection costs
  its client only a reconnect); when every other connection has a request in flight, the
  new connection is answered with a 503 and closed.

`ConnectionGuard` holds the state all connections of one server share: the connections
waiting for headers, oldest first, and counters (`closed_idle`, `closed_over_cap`) that
tests and `/metrics` may read. Everything runs on the event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("tandem.server")

DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0

_BUSY_BODY = json.dumps(
    {
        "error": {
            "message": "the server has too many connections with requests in flight; retry later",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
).encode()
_BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
    + str(len(_BUSY_BODY)).encode()
    + b"\r\n\r\n"
    + _BUSY_BODY
)


@dataclass
class ConnectionGuard:
    """Shared state of one server's connections (see the module docstring)."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    #: Connections waiting for a request's headers, in the order they started waiting.
    waiting: OrderedDict[Any, None] = field(default_factory=OrderedDict)
    open: set[Any] = field(default_factory=set)
    closed_idle: int = 0
    closed_over_cap: int = 0

    def opened(self, conn: Any) -> None:
        """A new connection: make room under the cap (the longest-waiting idle connection
        goes; with none idle but `conn`, `conn` gets a 503)."""
        self.open.add(conn)
        self.waiting[conn] = None
        if len(self.open) <= self.max_connections:
            return
        victim = next(iter(self.waiting))
        self.closed_over_cap += 1
        if victim is conn and len(self.waiting) == 1:
            conn.transport.write(_BUSY_RESPONSE)
        victim.close_idle()

    def closed(self, conn: Any) -> None:
        self.open.discard(conn)
        self.waiting.pop(conn, None)


def _protocol_base(http: Any) -> type:
    """uvicorn's HTTP protocol class for `http` ("auto": httptools when installed)."""
    if not isinstance(http, str):
        return http
    if http in ("auto", "httptools"):
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            return HttpToolsProtocol
        except ImportError:
            if http == "httptools":
                raise
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


def guarded_protocol(http: Any, guard: ConnectionGuard) -> type:
    """uvicorn's protocol class for `http` with the header deadline and connection cap
    of `guard`; pass it as `uvicorn.Config(http=...)`."""
    base = _protocol_base(http)

    class GuardedProtocol(base):  # type: ignore[misc, valid-type]
        """`base` plus the header deadline and the connection cap (module docstring)."""

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._waiting_cycle: Any = None
            guard.opened(self)
            if not transport.is_closing():
                self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            guard.closed(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._waiting_cycle:
                self._stop_header_timer()  # a request's headers are complete
                guard.waiting.pop(self, None)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (
                self.cycle is None or self.cycle.response_complete
            ):
                guard.waiting[self] = None
                self._await_headers()

        def _await_headers(self) -> None:
            self._stop_header_timer()
            self._waiting_cycle = self.cycle
            self._header_timer = self.loop.call_later(guard.header_timeout_s, self._header_timeout)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.cycle is self._waiting_cycle and not self.transport.is_closing():
                guard.closed_idle += 1
                self.close_idle()

        def close_idle(self) -> None:
            """Close this connection, which has no request in flight."""
            self._stop_header_timer()
            # At once, here and in uvicorn's own count (its `limit_concurrency` check):
            # the transport reports its loss only on a later turn of the loop.
            guard.closed(self)
            self.connections.discard(self)
            if not self.transport.is_closing():
                self.transport.close()

    GuardedProtocol.__name__ = f"Guarded{base.__name__}"
    GuardedProtocol.__qualname__ = GuardedProtocol.__name__
    return GuardedProtocol


def raise_open_files_limit(wanted: int) -> int:
    """Raise this process's soft limit on open files towards `wanted` (never past the
    hard limit, as vLLM does at start); returns the soft limit now in force."""
    try:
        import resource
    except ImportError:  # not POSIX
        return wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit to %d: %s", target, exc)
    return wanted if soft == resource.RLIM_INFINITY else soft
