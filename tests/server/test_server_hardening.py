"""Regression tests for the server findings of issue 24, without an engine process: the
app on a recording fake engine (with the embedded SmolLM2's real tokenizer where a real
vocabulary or chat template matters), and the hardening pieces on their own.

Each test failed on the code before its fix: request templates read as files and rendered
without a bound, bad words tokenised quadratically on the event loop, tokenising and
templating on the event loop, 500s for deep JSON, 64-bit overflows and lone surrogates,
`max_tokens` omitted vs null disagreeing, logprob `bytes` that do not join into the text,
and requests cut off by shutdown. The live-server versions are test_hostile_clients.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tandem.request_builder import bad_words_token_ids
from tandem.schema.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.schema.sampling_params import SamplingParams
from tandem.server.api_server import ServerSettings, build_app
from tandem.server.drain import Drain, guard_stream
from tandem.server.errors import APIError
from tandem.server.limits import MAX_JSON_DEPTH, parse_json_body
from tandem.server.logprobs import TokenBytes, chat_logprobs
from tandem.server.serving_common import run_cancellable
from tandem.server.template_guard import TemplateBudget, TemplateBudgetError, bounded_render

NESTED_LOOPS = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{{ messages[0]['content'] }}"
)
CHAT = {"messages": [{"role": "user", "content": "Name a colour."}]}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The embedded SmolLM2's tokenizer (byte-level BPE, with its chat template)."""
    from tandem.models.model_files import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir("default"))


class RecordingTokenizer:
    """Wraps a real tokenizer and records the thread of every call to it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.threads: list[str] = []
        self.chat_template = inner.chat_template

    def _record(self) -> None:
        self.threads.append(threading.current_thread().name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._record()
        return self.inner(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self._record()
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class FakeEngine:
    """Answers every request with the tokens of `reply`; keeps the params it was given."""

    def __init__(self, tokenizer: Any, reply: str = "Blue.") -> None:
        self.tokenizer = tokenizer
        self.max_model_len = 512
        self.dead_error: str | None = None
        self.reply_ids = tokenizer.encode(reply, add_special_tokens=False)
        self.params: list[SamplingParams] = []
        self.prompts: list[dict[str, Any]] = []
        self.block: asyncio.Event | None = None

    def is_healthy(self) -> bool:
        return self.dead_error is None

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams()

    async def generate(
        self, prompt: dict, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        self.params.append(params)
        self.prompts.append(prompt)
        if self.block is not None:
            await self.block.wait()
        ids = self.reply_ids[: params.max_tokens]
        logprobs = None
        if params.logprobs is not None:
            logprobs = [
                {t: Logprob(-0.5, 1, self.tokenizer.decode([t]))} for t in ids
            ]  # decoded alone, as the engine does: U+FFFD for part of a character
        text = self.tokenizer.decode(ids)
        out = CompletionOutput(0, text, list(ids), "length", None, logprobs)
        yield RequestOutput(
            request_id, prompt.get("prompt"), prompt["prompt_token_ids"], [out], True,
            RequestMetrics(0),
        )  # fmt: skip


def client_for(engine: FakeEngine, **settings: Any) -> TestClient:
    app = build_app(engine, ServerSettings(served_model_names=["fake"], **settings))
    return TestClient(app)


def ascii_post(c: TestClient, path: str, body: Any) -> Any:
    """POST `body` as ASCII JSON (a lone surrogate travels as a `\\udXXX` escape)."""
    return c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def error_of(response: Any, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"]
    assert error["param"] == param, error
    return error


# Request chat templates -------------------------------------------------------------------


def test_a_request_template_that_names_a_file_is_refused_and_never_read(
    tokenizer: Any, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-VALUE")
    with client_for(FakeEngine(tokenizer)) as c:
        for path in (str(secret), "/proc/self/environ"):
            r = c.post("/tokenize", json={**CHAT, "chat_template": path})
            error_of(r, 400, "chat_template")
            r = c.post("/v1/chat/completions", json={**CHAT, "chat_template": path})
            error_of(r, 400, "chat_template")
            kwargs = {"chat_template_kwargs": {"chat_template": path}}
            r = c.post("/tokenize", json={**CHAT, **kwargs})
            error_of(r, 400, "chat_template_kwargs.chat_template")
    # Trusted, a template is text: a path renders as the literal text, never the file.
    with client_for(FakeEngine(tokenizer), trust_request_chat_template=True) as c:
        r = c.post("/tokenize", json={**CHAT, "chat_template": str(secret)})
        assert r.status_code == 200, r.text
        text = c.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert text == str(secret) and "TOP-SECRET" not in text


def test_template_kwargs_cannot_reach_the_call(tokenizer: Any) -> None:
    with client_for(FakeEngine(tokenizer)) as c:
        for key in ("tokenize", "tokenizer_kwargs", "return_dict", "conversation", "_x"):
            body = {**CHAT, "chat_template_kwargs": {key: True}}
            error_of(c.post("/tokenize", json=body), 400, f"chat_template_kwargs.{key}")
        ok = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
        assert c.post("/tokenize", json=ok).status_code == 200


def test_a_nested_loop_template_is_stopped_with_a_400(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    with client_for(engine, trust_request_chat_template=True) as c:
        r = c.post("/tokenize", json={**CHAT, "chat_template": NESTED_LOOPS})
        error = error_of(r, 400, "chat_template")
        assert "template steps" in error["message"] or "longer than" in error["message"]
        assert c.get("/health").status_code == 200


def test_bounded_render_limits_steps_output_and_restores_the_tracer(tokenizer: Any) -> None:
    budget = TemplateBudget(max_steps=10_000, max_chars=1000, max_seconds=30)
    messages = CHAT["messages"]
    with pytest.raises(TemplateBudgetError, match="template steps"):
        bounded_render(
            lambda: tokenizer.apply_chat_template(
                messages, chat_template=NESTED_LOOPS, tokenize=False
            ),
            budget,
        )
    huge = "{% for i in range(5000) %}xxxxxxxxxx{% endfor %}"
    with pytest.raises(TemplateBudgetError, match="characters"):
        bounded_render(
            lambda: tokenizer.apply_chat_template(messages, chat_template=huge, tokenize=False),
            budget,
        )
    seen: list[str] = []

    def outer(frame: Any, event: str, arg: Any) -> None:
        seen.append(event)

    import sys

    previous = sys.gettrace()
    sys.settrace(outer)
    try:
        text = bounded_render(
            lambda: tokenizer.apply_chat_template(messages, tokenize=False), budget
        )
        assert sys.gettrace() is outer
    finally:
        sys.settrace(previous)
    assert "Name a colour." in text


# Off the event loop ----------------------------------------------------------------------


def test_templating_tokenising_and_bad_words_run_off_the_event_loop(tokenizer: Any) -> None:
    recording = RecordingTokenizer(tokenizer)
    engine = FakeEngine(recording)
    words = [f"word{i}" for i in range(50)]
    with client_for(engine) as c:
        recording.threads.clear()
        r = c.post("/v1/chat/completions", json={**CHAT, "bad_words": words, "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = c.post("/tokenize", json={"prompt": "Hi there"})
        assert r.status_code == 200, r.text
    assert recording.threads, "the tokenizer was never called"
    on_loop = [t for t in recording.threads if not t.startswith("tandem-preprocess")]
    assert not on_loop, f"tokenizer calls on the event loop's thread: {on_loop[:5]}"
    chat_params = engine.params[0]
    assert chat_params.bad_words == [] and len(chat_params.bad_words_token_ids) >= len(words)


class _CountingIds(list):
    """A token-id list that counts the comparisons made against it."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        _CountingIds.comparisons += 1
        return list.__eq__(self, other)  # type: ignore[arg-type]

    __hash__ = None  # type: ignore[assignment]


def test_bad_words_tokenising_is_linear_and_batched() -> None:
    calls: list[int] = []

    def tokenizer(texts: list[str], add_special_tokens: bool = False) -> dict[str, Any]:
        assert isinstance(texts, list) and not add_special_tokens
        calls.append(len(texts))
        return {"input_ids": [_CountingIds([hash(t) % 1000, len(t)]) for t in texts]}

    words = [f"w{i}" for i in range(400)]
    _CountingIds.comparisons = 0
    sequences = bad_words_token_ids(tokenizer, words, [[7]])
    assert calls == [2 * len(words)]  # one batched call: both variants of every word
    # Each word as written and with a leading space, each distinct sequence once, in order.
    expected: list[list[int]] = [[7]]
    for word in words:
        for variant in (word, " " + word):
            ids = [hash(variant) % 1000, len(variant)]
            if ids not in expected:
                expected.append(ids)
    assert sequences == expected
    assert _CountingIds.comparisons <= 2 * len(words), _CountingIds.comparisons


# Malformed input ---------------------------------------------------------------------------


def test_deep_json_is_a_400_naming_where() -> None:
    shallow = json.dumps({"x": [[[1]]]}).encode()
    assert parse_json_body(shallow) == {"x": [[[1]]]}
    for depth in (MAX_JSON_DEPTH + 1, 5000, 100_000):
        raw = b'{"prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
        with pytest.raises(APIError) as info:
            parse_json_body(raw)
        assert info.value.status == 400 and "nested deeper" in info.value.message


def test_malformed_inputs_are_400s_with_error_bodies(tokenizer: Any) -> None:
    with client_for(FakeEngine(tokenizer)) as c:
        deep = '{"prompt": "hi", "x": ' + "[" * 5000 + "]" * 5000 + "}"
        r = c.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
        error_of(ascii_post(c, "/tokenize", {"prompt": "\ud800"}), 400, "prompt")
        surrogate = {"messages": [{"role": "user", "content": "a\udfffb"}]}
        r = ascii_post(c, "/v1/chat/completions", surrogate)
        error_of(r, 400, "messages.0.content")
        big = 2**70
        for field in ("priority", "top_k", "truncate_prompt_tokens", "min_tokens"):
            r = c.post("/v1/completions", json={"prompt": "hi", field: big})
            error_of(r, 400, field)
        error_of(c.post("/v1/completions", json={"prompt": "", "max_tokens": 2}), 400, "prompt")
        r = c.post("/v1/completions", json={"prompt": "hi", "bad_words": ["a", ""]})
        error_of(r, 400, "bad_words")
        r = c.post("/v1/completions", json={"prompt": "hi", "bad_words": ["x"] * 5000})
        error_of(r, 400, "bad_words")
        r = c.post("/v1/completions", json={"prompt": "hi", "stop": ["s"] * 300})
        error_of(r, 400, "stop")
        bias = {str(i): 1.0 for i in range(5000)}
        error_of(c.post("/v1/completions", json={"prompt": "hi", "logit_bias": bias}), 400,
                 "logit_bias")  # fmt: skip
        many = {"messages": [{"role": "user", "content": "x"}] * 5000}
        error_of(c.post("/v1/chat/completions", json=many), 400, "messages")
        error_of(c.post("/v1/completions", json={"prompt": "hi", "n": 100_000}), 400, "n")


def test_max_tokens_omitted_and_null_both_clamp_to_the_room_left(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, reply="a b c d e f g h")
    prompt = [5] * 511  # max_model_len is 512: one position left
    with client_for(engine) as c:
        omitted = c.post("/v1/completions", json={"prompt": prompt})
        null = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": None})
        short = c.post("/v1/completions", json={"prompt": [5] * 10})
        explicit = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16})
    assert omitted.status_code == 200, omitted.text
    assert null.status_code == 200, null.text
    assert short.status_code == 200, short.text
    assert [p.max_tokens for p in engine.params] == [1, 1, 16]  # omitted: 16 where it fits
    error_of(explicit, 400, "max_tokens")  # an explicit budget that does not fit (vLLM)


# Logprob bytes ----------------------------------------------------------------------------


def test_chat_logprob_bytes_join_into_the_text_across_split_characters(tokenizer: Any) -> None:
    text = "😀🎉 hi é"
    ids = tokenizer.encode(text, add_special_tokens=False)
    steps = [{t: Logprob(-0.1, 1, tokenizer.decode([t]))} for t in ids]
    assert any(s[t].decoded_token == "\ufffd" for s, t in zip(steps, ids, strict=True))
    out = chat_logprobs(ids, steps, 0, TokenBytes(tokenizer))
    assert out.content is not None
    joined = b"".join(bytes(entry.bytes or []) for entry in out.content)
    assert joined == text.encode("utf-8")
    with client_for(FakeEngine(tokenizer, reply=text)) as c:
        body = {**CHAT, "logprobs": True, "max_tokens": 50}
        r = c.post("/v1/chat/completions", json=body).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == r["choices"][0]["message"][
        "content"
    ].encode("utf-8")


# API key ----------------------------------------------------------------------------------


def test_the_key_covers_every_route_but_the_open_ones(tokenizer: Any) -> None:
    with client_for(FakeEngine(tokenizer), api_key="sk-right") as c:
        for method, path, body in (
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/detokenize", {"tokens": [1, 2]}),
            ("POST", "/v1/completions", {"prompt": "hi"}),
            ("POST", "/v1/chat/completions", CHAT),
            ("GET", "/v1/models", None),
        ):
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
                r = c.request(method, path, json=body, headers=headers)
                error_of(r, 401, None)
        for path in ("/health", "/version", "/metrics"):
            assert c.get(path).status_code == 200, path
        ok = c.post(
            "/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer sk-right"}
        )
        assert ok.status_code == 200


# Shutdown ---------------------------------------------------------------------------------


def test_drain_ends_a_stream_with_an_error_and_a_request_with_a_503() -> None:
    async def scenario() -> tuple[list[str], Any, Any]:
        drain = Drain()
        gate = asyncio.Event()

        async def slow_chunks() -> AsyncIterator[str]:
            yield '{"n": 1}'
            await gate.wait()
            yield '{"n": 2}'

        got: list[str] = []

        async def consume() -> None:
            async for chunk in guard_stream(slow_chunks(), drain):
                got.append(chunk)

        consumer = asyncio.ensure_future(consume())

        async def never_disconnects() -> dict[str, Any]:
            await asyncio.sleep(3600)
            return {}

        async def slow_work() -> int:
            await asyncio.sleep(3600)
            return 1

        plain = asyncio.ensure_future(
            run_cancellable(never_disconnects, slow_work(), drain.waiter())
        )
        await asyncio.sleep(0.01)
        drain.abort_all()
        stream_result = await asyncio.gather(consumer, return_exceptions=True)
        plain_result = await asyncio.gather(plain, return_exceptions=True)
        return got, stream_result[0], plain_result[0]

    got, stream_error, plain_error = asyncio.run(scenario())
    assert got == ['{"n": 1}']
    assert isinstance(stream_error, APIError) and stream_error.status == 503
    assert isinstance(plain_error, APIError) and plain_error.status == 503


def test_sse_of_an_aborted_stream_is_an_error_event_then_done(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    engine.block = asyncio.Event()  # the request never finishes on its own
    with client_for(engine) as c:
        app = c.app
        result: dict[str, Any] = {}

        def request() -> None:
            body = {**CHAT, "stream": True, "max_tokens": 3}
            result["r"] = c.post("/v1/chat/completions", json=body)

        thread = threading.Thread(target=request)
        thread.start()
        try:
            _wait_until(lambda: engine.params, 20.0)
            c.portal.call(app.state.drain.abort_all)  # type: ignore[union-attr]
            thread.join(20.0)
        finally:
            c.portal.call(engine.block.set)  # type: ignore[union-attr]
            thread.join(20.0)
    response = result["r"]
    assert response.status_code == 200
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]


def _wait_until(probe: Any, timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.01)
