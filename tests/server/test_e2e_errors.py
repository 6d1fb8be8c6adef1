"""Refusals against a live `tandem serve scripted` process started with an API key, one
running sequence and no waiting room (`--max-num-seqs 1 --max-num-waiting 0`) and a
16 KiB body limit: malformed JSON, wrong types, out-of-range values, over-long prompts, a
bad API key, an unknown model, a full queue and an oversized body each get their status
code and an OpenAI-style body `{"error": {"message", "type", "param", "code"}}` naming
the problem, and after each the server still serves a normal request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from e2e_helpers import ServerProcess, assert_error_body, post, running_server, sse_events

from tandem.testing.scripted_model import scripted_next_token

KEY = "sk-e2e-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 1024
BODY_LIMIT = 16 * 1024
PROMPT = [4, 8, 15, 16]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    flags = ["--api-key", KEY, "--max-num-seqs", "1", "--max-num-waiting", "0"]
    flags += ["--max-request-body-bytes", str(BODY_LIMIT), "--max-model-len", str(MAX_MODEL_LEN)]
    with running_server("scripted", *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def completions(server: ServerProcess, body: Any, headers: dict[str, str] | None = None) -> Any:
    return post(server.url, "/v1/completions", body, {**AUTH, **(headers or {})})


def request(**fields: Any) -> dict[str, Any]:
    """A valid completions body with `fields` changed."""
    return {"model": "scripted", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}


def assert_still_serves(server: ServerProcess) -> None:
    resp = completions(server, request(ignore_eos=True))
    assert resp.status_code == 200, resp.text
    history = list(PROMPT)
    for _ in range(4):
        history.append(scripted_next_token(history, 128))
    assert resp.json()["choices"][0]["token_ids"] == history[len(PROMPT) :]


def test_malformed_json_is_400(server: ServerProcess) -> None:
    for body in (b'{"model": "scripted", "prompt": [1, 2', b"\xff\xfe", b"[1, 2, 3]"):
        error = assert_error_body(completions(server, body), 400, "JSON")
        assert error["type"] == "BadRequestError"
    assert_still_serves(server)


def test_wrong_types_are_400_naming_the_field(server: ServerProcess) -> None:
    cases = {
        "max_tokens": request(max_tokens="ten"),
        "temperature": request(temperature="hot"),
        "prompt": request(prompt={"text": "x"}),
        "stop_token_ids": request(stop_token_ids=["a"]),
    }
    for field, body in cases.items():
        error = assert_error_body(completions(server, body), 400, field)
        assert error["param"] is not None and error["param"].startswith(field), (field, error)
    assert_still_serves(server)


def test_out_of_range_values_are_400_naming_the_field(server: ServerProcess) -> None:
    cases = {
        "temperature": request(temperature=-1),
        "top_p": request(top_p=1.5),
        "n": request(n=0),
        "max_tokens": request(max_tokens=0),
        "logprobs": request(logprobs=10_000),
        "top_k": request(top_k=-5),
    }
    for field, body in cases.items():
        error = assert_error_body(completions(server, body), 400, field)
        assert error["param"] == field, (field, error)
    assert_still_serves(server)


def test_prompt_over_max_model_len_is_400(server: ServerProcess) -> None:
    too_long = [7] * (MAX_MODEL_LEN + 1)
    error = assert_error_body(completions(server, request(prompt=too_long)), 400, "max_model_len")
    assert error["param"] in ("prompt", "max_tokens"), error
    assert str(MAX_MODEL_LEN) in error["message"]
    assert_still_serves(server)


def test_prompt_plus_max_tokens_over_max_model_len_is_400(server: ServerProcess) -> None:
    body = request(prompt=[7] * (MAX_MODEL_LEN - 10), max_tokens=11)
    error = assert_error_body(completions(server, body), 400, "max_tokens", "max_model_len")
    assert error["param"] in ("prompt", "max_tokens"), error
    ok = completions(server, request(prompt=[7] * (MAX_MODEL_LEN - 10), max_tokens=10))
    assert ok.status_code == 200, ok.text  # exactly fits
    assert_still_serves(server)


def test_bad_api_key_is_401(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = post(server.url, "/v1/completions", request(), headers)
        assert_error_body(resp, 401, "API key")
        resp = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10)
        assert_error_body(resp, 401, "API key")
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="scripted", prompt=PROMPT, max_tokens=2)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200  # not a /v1 route
    assert_still_serves(server)


def test_unknown_model_is_404(server: ServerProcess, client: openai.OpenAI) -> None:
    error = assert_error_body(completions(server, request(model="gpt-9")), 404, "gpt-9")
    assert error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
    assert_still_serves(server)


def test_full_queue_is_429_with_retry_after(server: ServerProcess) -> None:
    """One sequence runs (a long stream, its first chunk read) and none may wait: the next
    request is refused at once; once the stream is closed the server serves again."""
    body = request(max_tokens=MAX_MODEL_LEN - 10, ignore_eos=True, stream=True)
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=30
    ) as running:
        assert running.status_code == 200
        events = sse_events(running.iter_lines())  # kept: closing it closes the response
        first = next(events)
        assert json.loads(first)["choices"][0]["token_ids"]
        resp = completions(server, request())
        assert_error_body(resp, 429)
        retry = resp.headers.get("Retry-After")
        assert retry is not None and retry.isdigit() and int(retry) >= 1, resp.headers
    assert_still_serves(server)


def test_oversized_body_is_413(server: ServerProcess) -> None:
    big = request(prompt=[7] * (BODY_LIMIT // 2))
    assert len(json.dumps(big)) > BODY_LIMIT
    assert_error_body(completions(server, big), 413, str(BODY_LIMIT))

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield json.dumps(big).encode()

    resp = httpx.post(
        f"{server.url}/v1/completions",
        content=chunked(),
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=30,
    )
    assert_error_body(resp, 413, str(BODY_LIMIT))
    assert_still_serves(server)
