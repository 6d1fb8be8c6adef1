"""Raw-socket clients that misbehave, for the hostile-client tests and the benchmark.

Every helper is bounded: a fixed number of sockets, a timeout on every wait, and every
socket it opens is closed by `close_all` (or the context manager) whatever happened. They
speak to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

HOST = "127.0.0.1"


def open_idle(port: int, count: int, timeout_s: float = 5.0) -> list[socket.socket]:
    """`count` connections that send nothing (a socket flood); those the server refuses
    at connect time are left out."""
    socks: list[socket.socket] = []
    for _ in range(count):
        sock = socket.socket()
        sock.settimeout(timeout_s)
        try:
            sock.connect((HOST, port))
        except OSError:
            sock.close()
            continue
        socks.append(sock)
    return socks


def start_slowloris(port: int, count: int) -> list[socket.socket]:
    """`count` connections that start a request's headers and never finish them."""
    socks = open_idle(port, count)
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    return socks


def dribble(socks: list[socket.socket]) -> None:
    """One more header line on each slowloris connection still open."""
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.sendall(b"X-a: b\r\n")


def is_closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    """True once the server closed `sock` (EOF or reset, a 503 before EOF counts), within
    `wait_s`; False if it is still open then."""
    deadline = time.monotonic() + wait_s
    sock.settimeout(max(0.001, min(0.2, wait_s)))
    while True:
        try:
            data = sock.recv(4096)
        except TimeoutError:
            if time.monotonic() >= deadline:
                return False
            continue
        except OSError:
            return True
        if not data:
            return True


def count_closed(socks: list[socket.socket], wait_s: float) -> int:
    """How many of `socks` the server closed, waiting at most `wait_s` in all."""
    deadline = time.monotonic() + wait_s
    closed = 0
    for sock in socks:
        left = max(0.0, deadline - time.monotonic())
        if is_closed_by_server(sock, min(left, 2.0)):
            closed += 1
    return closed


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.close()


@contextlib.contextmanager
def sockets(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    """`socks`, closed on exit."""
    try:
        yield socks
    finally:
        close_all(socks)


def raw_request(port: int, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Send `data` on a new connection and read until the server closes it or `timeout_s`
    passes; the bytes received."""
    with socket.create_connection((HOST, port), timeout=timeout_s) as sock:
        sock.sendall(data)
        chunks: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, OSError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
