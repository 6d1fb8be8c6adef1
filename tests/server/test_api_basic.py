"""The HTTP server on the real `AsyncLLM` (scripted model, one engine-core process).

One server per module: `build_app` under uvicorn in a thread (`serve_until_dead`, as
`tandem serve` runs it), on 127.0.0.1 with an API key, a 64 KiB body limit, max_num_seqs 4
and max_num_waiting 0. The engine-death test kills the engine core, so it runs last.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tandem.testing.scripted_model import scripted_next_token

KEY = "sk-test"
VOCAB = 128
HEADERS = {"Authorization": f"Bearer {KEY}"}


class _FinishReasons:
    """A stat logger that keeps every finished request's reason (abort, length, ...)."""

    def __init__(self) -> None:
        self.reasons: list[str | None] = []

    def record(self, engine_index: int, engine_stats: Any, iteration: Any) -> None:
        if iteration is not None:
            self.reasons += [f.finish_reason for f in iteration.finished]


class _Server:
    def __init__(self) -> None:
        import uvicorn

        from tandem.engine import AsyncLLM
        from tandem.server.api_server import (
            ServerSettings,
            _add_metrics,
            build_app,
            serve_until_dead,
        )

        self.finished = _FinishReasons()
        self.engine = AsyncLLM(
            model="scripted",
            worker_num_threads=1,
            max_num_seqs=4,
            max_num_waiting=0,
            stat_loggers=[self.finished],
        )
        _add_metrics(self.engine, "scripted", 1)
        settings = ServerSettings(
            served_model_names=["scripted"], api_key=KEY, max_request_body_bytes=64 * 1024
        )
        app = build_app(self.engine, settings)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.exit_code: int | None = None

        def run() -> None:
            coro = serve_until_dead(self.uvicorn, self.engine, [self.sock], hard_exit_s=None)
            self.exit_code = asyncio.run(coro)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.uvicorn.started

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()
        self.sock.close()


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    srv = _Server()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def client(server: _Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=30) as c:
        yield c


def _greedy(prompt: list[int], n: int) -> list[int]:
    history, out = list(prompt), []
    for _ in range(n):
        out.append(scripted_next_token(history, VOCAB))
        history.append(out[-1])
    return out


def _events(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


def _error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    return error


def test_completion_greedy_tokens_usage_and_finish_reason(client: httpx.Client) -> None:
    body = {"model": "scripted", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "scripted"
    (choice,) = out["choices"]
    assert choice["token_ids"] == _greedy([5, 6, 7], 6)
    assert choice["finish_reason"] == "length" and choice["text"] == ""
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_batch_prompts_and_n_index_choices_across_prompts(client: httpx.Client) -> None:
    body = {"prompt": [[5, 6, 7], [9, 10]], "max_tokens": 3, "n": 2, "temperature": 0}
    out = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["choices"][2]["token_ids"] == _greedy([9, 10], 3)
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


def test_completion_logprobs_shape(client: httpx.Client) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "logprobs": 2, "temperature": 0}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    first = _greedy([5, 6, 7], 1)[0]
    assert lp["tokens"][0] == f"token_id:{first}" and len(lp["top_logprobs"][0]) == 2
    assert lp["token_logprobs"][0] == max(lp["top_logprobs"][0].values())


def test_stream_one_event_per_delta_then_usage_then_done(client: httpx.Client) -> None:
    body = {
        "prompt": [5, 6, 7],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = client.post("/v1/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    *chunks, last = events
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == _greedy([5, 6, 7], 4)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4


def test_seeded_sampling_is_reproducible(client: httpx.Client) -> None:
    body = {"prompt": [3, 4], "max_tokens": 8, "temperature": 1.5, "seed": 7}
    a = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    b = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    assert a == b


def test_unknown_field_is_ignored(client: httpx.Client) -> None:
    body = {"prompt": [5], "max_tokens": 1, "some_future_option": {"x": 1}}
    assert client.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [5, 6], "temperature": -1}, "temperature"),
        ({"prompt": [5, 6], "temperature": "hot"}, "temperature"),
        ({"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [5, 6], "n": "two"}, "n"),
        ({"prompt": [5.5, 6]}, "prompt"),
        ({"prompt": [5] * 1024}, "prompt"),
        ({"prompt": [5] * 1000, "max_tokens": 100}, "max_tokens"),
        ({"prompt": "text needs a tokenizer"}, "prompt"),
        ({"prompt": [5], "response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_bad_request_names_the_field(client: httpx.Client, body: dict, param: str) -> None:
    _error(client.post("/v1/completions", json=body), 400, param)


def test_malformed_json_is_400(client: httpx.Client) -> None:
    r = client.post("/v1/completions", content=b'{"prompt": [1,', headers=HEADERS)
    assert "JSON" in _error(r, 400, None)["message"]


def test_unknown_model_is_404(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": "gpt-5", "prompt": [1]})
    assert _error(r, 404, "model")["type"] == "NotFoundError"


def test_api_key_required_on_v1_routes(server: _Server) -> None:
    r = httpx.get(f"{server.url}/v1/models")
    _error(r, 401, None)
    bad = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
    _error(bad, 401, None)
    assert httpx.get(f"{server.url}/health").status_code == 200  # not a /v1 route


def test_body_over_limit_is_413(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": [1] * 40_000})
    _error(r, 413, None)


def test_full_queue_is_429_with_retry_after(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": [1, 2], "n": 5, "max_tokens": 2})
    _error(r, 429, None)
    assert int(r.headers["retry-after"]) >= 1


def test_chat_without_tokenizer_is_400(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    _error(r, 400, "messages")


def test_tokenize_without_tokenizer_is_400(client: httpx.Client) -> None:
    _error(client.post("/tokenize", json={"prompt": "hello"}), 400, "prompt")
    _error(client.post("/detokenize", json={"tokens": [1, 2]}), 400, "tokens")


def test_models_health_version_metrics(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["scripted"]
    assert models["data"][0]["max_model_len"] == 1024
    assert client.get("/health").status_code == 200
    assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200
    assert client.get("/version").json()["version"]
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "tandem:num_requests_running" in metrics.text


def test_official_openai_client(server: _Server) -> None:
    import openai

    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=30)
    assert [m.id for m in api.models.list()] == ["scripted"]
    out = api.completions.create(model="scripted", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    stream = api.completions.create(
        model="scripted",
        prompt=[5, 6, 7],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.total_tokens == 6 and chunks[-2].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="other", prompt=[1], max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        api.completions.create(model="scripted", prompt=[1], max_tokens=1, n=5)


def _wait_idle(server: _Server) -> None:
    deadline = time.monotonic() + 10
    while server.engine.num_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.num_unfinished() == 0


LONG = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}


def test_stream_disconnect_aborts_the_request(server: _Server, client: httpx.Client) -> None:
    _wait_idle(server)
    before = len(server.finished.reasons)
    with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    _wait_idle(server)
    assert server.finished.reasons[before:] == ["abort"]


def test_non_streaming_disconnect_aborts_the_request(server: _Server) -> None:
    _wait_idle(server)
    before = len(server.finished.reasons)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, headers=HEADERS, timeout=0.3)
    _wait_idle(server)
    assert server.finished.reasons[before:] == ["abort"]


def test_zz_engine_death_fails_the_stream_health_503_and_server_stops(
    server: _Server, client: httpx.Client
) -> None:
    """Runs last (it kills the module's engine)."""
    body = {"prompt": [5, 6, 7], "max_tokens": 900, "stream": True, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        server.engine.client.processes[0].kill()
        rest = [line for line in lines if line]
    errors = [json.loads(x[6:]) for x in rest if x.startswith("data: {") and '"error"' in x]
    assert errors and errors[0]["error"]["type"] == "EngineDeadError"
    assert rest[-1] == "data: [DONE]"
    server.thread.join(timeout=5)
    assert not server.thread.is_alive() and server.exit_code == 1
    assert server.engine.dead_error is not None
