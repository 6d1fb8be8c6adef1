"""`tandem serve` restarts a dead engine core: killing it under load fails the requests in
flight (an error event or an error body, never a hang), /health answers 503 while the new
engine core starts, the next requests are served with the right tokens, and /metrics counts
the restart. Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import httpx
from e2e_helpers import metric_values, running_server, scaled, sse_events, wait_for

from tandem.schema.sampling_params import SamplingParams
from tandem.testing import expected_scripted_output

#: The bound of every wait here on a quiet machine (each is `scaled`).
WAIT_S = 120.0
LONG = {"model": "scripted", "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True}


def post(url: str, body: dict[str, Any], out: list[Any]) -> threading.Thread:
    def run() -> None:
        try:
            out.append(httpx.post(f"{url}/v1/completions", json=body, timeout=scaled(WAIT_S)))
        except httpx.HTTPError as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_killed_engine_core_is_restarted_and_serves_the_next_requests() -> None:
    with running_server("scripted", "--max-num-seqs", "4") as server:
        url = server.url
        (core,) = server.engine_core_pids()
        plain: list[Any] = []
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=scaled(WAIT_S)
        ) as resp:
            stream = sse_events(resp.iter_lines())
            assert json.loads(next(stream))["choices"][0]["token_ids"]
            waiters = [post(url, LONG, plain) for _ in range(3)]
            wait_for(
                lambda: (metric_values(url, "tandem:num_requests_running") or [0])[0] >= 2,
                scaled(WAIT_S),
                "requests running beside the stream",
            )
            os.kill(core, signal.SIGKILL)
            events = list(stream)
        for waiter in waiters:
            waiter.join(scaled(WAIT_S))
            assert not waiter.is_alive(), "a request in flight hangs after the engine died"

        assert events[-1] == "[DONE]" and '"error"' in events[-2], events[-3:]
        assert len(plain) == 3
        for resp in plain:
            assert isinstance(resp, httpx.Response), resp
            assert resp.status_code in (500, 503), resp.text
            assert "engine" in resp.json()["error"]["message"].lower()

        prompt = [5, 9, 11]
        done = httpx.post(
            f"{url}/v1/completions",
            json={"model": "scripted", "prompt": prompt, "max_tokens": 6, "temperature": 0},
            timeout=scaled(WAIT_S),
        )
        assert done.status_code == 200, done.text
        params = SamplingParams(temperature=0, max_tokens=6)
        want = expected_scripted_output(prompt, params, 128, 1, 1024)[0]
        assert done.json()["choices"][0]["token_ids"] == want
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, scaled(WAIT_S), "healthy")
        assert metric_values(url, "tandem:engine_core_restarts_total") == [1.0]
        assert len(server.engine_core_pids()) == 1 and server.engine_core_pids() != [core]
        assert server.proc.poll() is None
