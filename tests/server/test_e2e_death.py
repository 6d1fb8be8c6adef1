"""Killing the engine-core process of a live `tandem serve scripted --max-engine-restarts 0`
process mid-stream:
the streaming client gets an error event then `[DONE]`, a non-streaming request in
flight gets a 500 naming the engine's death, /health answers 503 while the server is
still up, and the server process exits non-zero within a bounded time. Every wait is
bounded: a hang fails the test instead of blocking it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import httpx
from e2e_helpers import ServerProcess, running_server, sse_events

EXIT_TIMEOUT_S = 10.0
LONG = {"model": "scripted", "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True}


def watch_health(server: ServerProcess, stop: threading.Event, seen: list[Any]) -> None:
    """Poll /health every 20 ms until `stop` (bounded by EXIT_TIMEOUT_S): status codes, or
    the exception name once the server no longer answers."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            seen.append(httpx.get(f"{server.url}/health", timeout=1.0).status_code)
        except httpx.HTTPError as exc:
            seen.append(type(exc).__name__)
        time.sleep(0.02)


def post_in_thread(server: ServerProcess, body: dict[str, Any], out: list[Any]) -> threading.Thread:
    def run() -> None:
        try:
            out.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=30))
        except httpx.HTTPError as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def read_after_kill(stream: Any) -> tuple[list[str], str | None]:
    """The rest of an SSE stream: (events, the transport error's name if it broke)."""
    events: list[str] = []
    try:
        for payload in stream:
            events.append(payload)
    except httpx.HTTPError as exc:
        return events, type(exc).__name__
    return events, None


def test_killing_the_engine_core_fails_requests_and_exits() -> None:
    with running_server("scripted", "--max-num-seqs", "4", "--max-engine-restarts", "0") as server:
        cores = server.engine_core_pids()
        assert len(cores) == 1, (cores, server.log())
        plain: list[Any] = []
        seen: list[Any] = []
        stop = threading.Event()
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={**LONG, "stream": True},
            timeout=EXIT_TIMEOUT_S,
        ) as resp:
            assert resp.status_code == 200
            stream = sse_events(resp.iter_lines())
            for _ in range(3):
                assert json.loads(next(stream))["choices"][0]["token_ids"]
            waiter = post_in_thread(server, LONG, plain)
            time.sleep(0.3)  # the non-streaming request is in flight
            os.kill(cores[0], signal.SIGKILL)
            watcher = threading.Thread(target=watch_health, args=(server, stop, seen))
            watcher.start()
            events, broken = read_after_kill(stream)
        waiter.join(EXIT_TIMEOUT_S)
        assert not waiter.is_alive(), "the non-streaming request hangs after the engine died"
        try:
            status = server.proc.wait(EXIT_TIMEOUT_S)
        finally:
            stop.set()
            watcher.join(EXIT_TIMEOUT_S + 2)
        assert status != 0, server.log()

    # vLLM's framing: a stream that fails midway gets one error event, then [DONE].
    assert broken is None, f"the stream broke ({broken}) instead of an error event"
    assert events[-1] == "[DONE]" and events[-2].startswith('{"error"'), events[-3:]
    error = json.loads(events[-2])["error"]
    assert "engine" in error["message"].lower() and error["code"] in (500, 503), error
    assert len(plain) == 1
    if isinstance(plain[0], httpx.Response):
        assert plain[0].status_code in (500, 503), plain[0].text
        assert "engine" in plain[0].json()["error"]["message"].lower()
    assert 503 in seen, f"/health never answered 503 before the server exited: {seen}"
    assert 200 not in seen[seen.index(503) :], seen
