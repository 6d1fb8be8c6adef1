"""Hostile clients against one live `tandem serve` (a tiny random Llama with the embedded
SmolLM2's tokenizer and chat template, 127.0.0.1 only), started once for the module with
an API key, a 64-connection cap, a 2 s header deadline and a 512-token context.

Each test throws one kind of abuse at it: file and /proc paths in every field that could
be read, every route without and with a wrong key, huge lists, deep nesting, invalid
Unicode, overflowing integers, a socket flood (300 idle sockets), slowloris clients. Each
abuse is refused (400/401/404/408/413) or survived, and after each test a normal client's
chat request still succeeds (the autouse `still_serves` fixture). Every loop is bounded in
count and time; nothing asserts a duration (benchmarks/hostile_clients.py measures the
latency a normal client sees meanwhile).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e_helpers import ServerProcess, assert_error_body, running_server, save_tiny_chat_model
from hostile_helpers import (
    count_closed,
    dribble,
    open_idle,
    raw_request,
    sockets,
    start_slowloris,
)

MODEL = "tiny"
KEY = "sk-hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Put in the server's environment: no response may ever carry it.
MARKER = "hostile-marker-7f3a9c"
MAX_CONNECTIONS = 64
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
PATHS = ("/proc/self/environ", "/etc/passwd", "file:///proc/self/environ", "../../etc/hosts")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-hostile"))
    flags = [
        "--served-model-name", MODEL, "--max-num-seqs", "8", "--max-model-len", "512",
        "--api-key", KEY, "--limit-concurrency", str(MAX_CONNECTIONS),
        "--timeout-request-header", "2", "--timeout-request-body", "5",
    ]  # fmt: skip
    with running_server(str(model_dir), *flags, env={"TANDEM_HOSTILE_MARKER": MARKER}) as srv:
        yield srv


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def still_serves(server: ServerProcess) -> Iterator[None]:
    """After each test: /health is 200 and a normal chat request succeeds."""
    yield
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"


def post_raw(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    """POST `body` as ASCII JSON (lone surrogates travel escaped) or raw bytes/str."""
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.post(path, content=content, headers={"content-type": "application/json"})


def no_marker(client: httpx.Client, r: httpx.Response) -> None:
    """`r` carries neither the marker nor the key, as text or (for /tokenize) as tokens."""
    assert MARKER not in r.text and KEY not in r.text, r.text[:500]
    if r.status_code == 200 and "tokens" in r.json():
        text = client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert MARKER not in text and KEY not in text


# Files -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_paths_in_template_fields_are_refused(client: httpx.Client, path: str) -> None:
    for route in ("/tokenize", "/v1/chat/completions"):
        r = client.post(route, json={**CHAT, "chat_template": path, "max_tokens": 2})
        assert_error_body(r, 400, "chat_template")
        assert r.json()["error"]["param"] == "chat_template"
        no_marker(client, r)
        kwargs = {"chat_template_kwargs": {"chat_template": path}}
        r = client.post(route, json={**CHAT, **kwargs, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("chat_template")
        for key in ("tokenizer_kwargs", "tokenize", "return_dict"):
            bad = {"chat_template_kwargs": {key: {"path": path}}}
            r = client.post(route, json={**CHAT, **bad, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"].startswith(
                "chat_template_kwargs"
            )


@pytest.mark.parametrize("path", PATHS)
def test_paths_in_other_fields_are_data_never_files(client: httpx.Client, path: str) -> None:
    attempts: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"model": path, "prompt": "hi", "max_tokens": 2}),
        ("/tokenize", {"model": path, "prompt": "hi"}),
        ("/v1/completions", {"model": MODEL, "prompt": path, "max_tokens": 2}),
        ("/tokenize", {"model": MODEL, "prompt": path}),
        ("/tokenize", {**CHAT, "chat_template_kwargs": {"file": path, "path": path}}),
        ("/v1/chat/completions", {**CHAT, "tokenizer": path, "max_tokens": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": [path]}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                             "bad_words": [path]}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                             "response_format": {"type": "json_schema", "json_schema": {
                                 "name": "x", "schema": {"$ref": path}}}}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                             "structured_outputs": {"json": {"$ref": path}}}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                             "structured_outputs": {"grammar": path}}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                             "guided_regex": path}),
    ]  # fmt: skip
    for route, body in attempts:
        r = client.post(route, json=body)
        assert r.status_code in (200, 400, 404), (route, body, r.status_code, r.text[:300])
        if r.status_code != 200:
            assert_error_body(r, r.status_code)
        no_marker(client, r)


# The key -----------------------------------------------------------------------------------

ROUTES = [
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/tokenize", {**CHAT, "chat_template": "{{ raise_exception('x') }}"}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
    ("GET", "/v1/models", None),
    ("GET", "/no/such/route", None),
    ("POST", "/health/../tokenize", {"prompt": "hi"}),
]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_every_route_needs_the_key(server: ServerProcess, headers: dict[str, str]) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for method, path, body in ROUTES:
            r = c.request(method, path, json=body, headers=headers)
            assert_error_body(r, 401)
        for path in ("/health", "/version", "/metrics", "/ping"):
            assert c.get(path, headers=headers).status_code == 200, path


# Big, deep and broken bodies ------------------------------------------------------------------


def test_huge_lists_are_400s_naming_the_field(client: httpx.Client) -> None:
    base = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/completions", {**base, "bad_words": ["w"] * 5000}, "bad_words"),
        ("/v1/completions", {**base, "stop": ["s"] * 300}, "stop"),
        ("/v1/completions", {**base, "stop": ["s" * 5000]}, "stop.0"),
        ("/v1/completions", {**base, "stop_token_ids": [1] * 5000}, "stop_token_ids"),
        ("/v1/completions", {**base, "logit_bias": {str(i): 1 for i in range(5000)}}, "logit_bias"),
        ("/v1/completions", {**base, "guided_choice": ["a"] * 5000}, "guided_choice"),
        ("/v1/completions", {**base, "n": 10_000}, "n"),
        ("/v1/completions", {**base, "prompt": ["hi"] * 5000}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 5000}, "messages"),
        ("/v1/chat/completions", {**CHAT, "tools": [TOOL] * 600}, "tools"),
    ]  # fmt: skip
    for route, body, param in cases:
        r = client.post(route, json=body)
        assert_error_body(r, 400)
        assert r.json()["error"]["param"] == param, (param, r.text[:300])


def test_over_the_body_limit_is_413(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * (2 << 20)})
    assert_error_body(r, 413)


def test_deep_nesting_is_a_400(client: httpx.Client) -> None:
    for depth in (100, 5000, 200_000):
        nest = "[" * depth + "]" * depth
        for route, body in (
            ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "x": {nest}}}'),
            ("/tokenize", f'{{"messages": [{{"role": "user", "content": {nest}}}]}}'),
            ("/v1/chat/completions", f'{{"messages": [], "chat_template_kwargs": {{"a": {nest}}}}}'),
        ):  # fmt: skip
            r = post_raw(client, route, body)
            assert_error_body(r, 400, "nested")


def test_invalid_unicode_is_a_400(client: httpx.Client) -> None:
    cases: list[tuple[str, Any]] = [
        ("/tokenize", {"prompt": "a\ud800b"}),
        ("/v1/completions", {"model": MODEL, "prompt": "\udfff", "max_tokens": 2}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["\ud83d"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
        ("/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
        ("/tokenize", b'{"prompt": "\xc3"}'),
    ]
    for route, body in cases:
        assert_error_body(post_raw(client, route, body), 400)


def test_malformed_values_are_400s(client: httpx.Client) -> None:
    base = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for field in ("priority", "top_k", "truncate_prompt_tokens", "seed", "min_tokens"):
        for value in (2**64, -(2**70), 10**40):
            r = client.post("/v1/completions", json={**base, field: value})
            assert_error_body(r, 400, field)
    for body, param in (
        ({**base, "prompt": ""}, "prompt"),
        ({**base, "prompt": [""]}, "prompt.0"),
        ({**base, "prompt": []}, "prompt"),
        ({**base, "prompt": [[]]}, "prompt.0"),
        ({**base, "bad_words": [""]}, "bad_words"),
        ({**base, "max_tokens": 0}, "max_tokens"),
    ):
        r = client.post("/v1/completions", json=body)
        assert_error_body(r, 400)
        assert r.json()["error"]["param"] == param, r.text
    for raw in (b"", b"{", b"[1, 2]", b"null", b'"x"', b"\x00\x01"):
        assert_error_body(post_raw(client, "/v1/completions", raw), 400)


def test_max_tokens_omitted_and_null_both_clamp(client: httpx.Client) -> None:
    prompt = [5] * 511
    for extra in ({}, {"max_tokens": None}):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1


# Connections ---------------------------------------------------------------------------------


def test_a_socket_flood_is_survived(server: ServerProcess) -> None:
    with sockets(open_idle(server.port, 300)) as flood:
        assert len(flood) >= MAX_CONNECTIONS
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
            for _ in range(5):  # new connections each: they push idle ones out
                with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as fresh:
                    assert fresh.get("/health").status_code == 200
            r = c.post("/tokenize", json={"prompt": "still here"})
            assert r.status_code == 200
        # The cap closed the oldest idle sockets; the header deadline the rest.
        assert count_closed(flood, wait_s=30.0) == len(flood)
    closed = closed_connections(server)
    assert closed["over_cap"] >= 1 and closed["header_timeout"] >= 1, closed


def test_slowloris_connections_are_closed(server: ServerProcess) -> None:
    with sockets(start_slowloris(server.port, 8)) as slow:
        for _ in range(3):  # keep dribbling: a header line every half second
            dribble(slow)
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            time.sleep(0.5)
        assert count_closed(slow, wait_s=30.0) == len(slow)
    assert closed_connections(server)["header_timeout"] >= len(slow)


def closed_connections(server: ServerProcess) -> dict[str, float]:
    """`tandem:http_connections_closed_total` by reason, from `/metrics`."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    closed = {}
    for line in text.splitlines():
        if line.startswith("tandem:http_connections_closed_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            closed[reason] = float(line.rsplit(" ", 1)[1])
    assert set(closed) == {"header_timeout", "over_cap"}, text[-2000:]
    return closed


def test_a_request_that_never_sends_its_body_gets_408(server: ServerProcess) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: 100\r\n\r\n{"
    )
    reply = raw_request(server.port, head, timeout_s=30.0)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_huge_bad_words_leave_health_answering(server: ServerProcess) -> None:
    words = [f"word{i} thing{i}" for i in range(1000)]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "bad_words": words}
    result: dict[str, Any] = {}

    def big() -> None:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
            result["r"] = c.post("/v1/completions", json=body)

    thread = threading.Thread(target=big)
    thread.start()
    health: list[int] = []
    try:
        while thread.is_alive() and len(health) < 200:
            health.append(httpx.get(f"{server.url}/health", timeout=10).status_code)
    finally:
        thread.join(120)
    assert result["r"].status_code == 200, result["r"].text[:300]
    assert health and set(health) == {200}
