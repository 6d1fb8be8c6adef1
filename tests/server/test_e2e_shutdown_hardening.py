"""SIGTERM with requests in flight, against a live `tandem serve` (tiny random Llama with
the embedded SmolLM2's tokenizer, 127.0.0.1, `--shutdown-timeout 1`).

Before the fix, uvicorn cancelled what was still running two seconds after the signal: a
non-streaming request got a plain-text `500 Internal Server Error` and a stream was cut
off without `[DONE]`. Now each ends properly (an OpenAI error body with 503, or an SSE
error event then `[DONE]`), or finishes if it can, and the process exits 0. Every wait is
bounded; nothing asserts a duration.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import ServerProcess, metric_values, save_tiny_chat_model, wait_for

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    model_dir = save_tiny_chat_model(tmp_path / "tiny")
    flags = ["--served-model-name", MODEL, "--max-model-len", "4096", "--shutdown-timeout", "1"]
    srv = ServerProcess(str(model_dir), *flags)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_sigterm_ends_requests_in_flight_with_proper_errors(server: ServerProcess) -> None:
    long = {"model": MODEL, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    results: dict[str, Any] = {}
    events: list[str] = []

    def stream() -> None:
        body = {**long, "messages": MESSAGES, "stream": True}
        with (
            httpx.Client(base_url=server.url, timeout=120) as c,
            c.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            results["stream_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])

    def plain() -> None:
        body = {**long, "prompt": "Once upon a time"}
        with httpx.Client(base_url=server.url, timeout=120) as c:
            results["plain"] = c.post("/v1/completions", json=body)

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(events) >= 3, 60.0, "the stream's first tokens")
        running = "tandem:num_requests_running"
        wait_for(lambda: sum(metric_values(server.url, running)) >= 2, 60.0, "both running")
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(60.0)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within 60 s of SIGTERM:\n{server.log()}")
    finally:
        for t in threads:
            t.join(60.0)
    assert code == 0, server.log()

    assert results["stream_status"] == 200
    assert events and events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    finished = bool(last.get("choices")) and last["choices"][0].get("finish_reason")
    if not finished:  # ended by the shutdown: an error event, not a cut
        assert last["error"]["code"] == 503 and "shutting down" in last["error"]["message"]

    plain_response: httpx.Response = results["plain"]
    assert plain_response.headers["content-type"].startswith("application/json")
    if plain_response.status_code != 200:
        error = plain_response.json()["error"]
        assert plain_response.status_code == 503 and error["code"] == 503, error
