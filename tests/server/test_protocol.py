"""The server's pieces without an engine process: request parsing, the mapping to
`SamplingParams`, error bodies, SSE framing, the thread budget, and the chat / tokenize
routes on a fake engine with a fake tokenizer (the scripted model has no tokenizer)."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tandem.engine.errors import EngineDeadError, QueueFullError
from tandem.schema.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tandem.schema.sampling_params import RequestOutputKind, SamplingParams
from tandem.server.api_server import ServerSettings, build_app
from tandem.server.budget import BudgetError, plan_budget
from tandem.server.errors import APIError, from_exception, from_validation_error
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.server.sse import framed
from tandem.server.to_sampling_params import (
    chat_sampling_params,
    completion_sampling_params,
    max_tokens_for,
)

DEFAULTS = SamplingParams()


def _completion(**body: Any) -> SamplingParams:
    return completion_sampling_params(CompletionRequest(prompt=[1], **body), 16, DEFAULTS)


def test_unknown_fields_are_accepted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        CompletionRequest(prompt=[1], brand_new_option=1)
        CompletionRequest(prompt=[1], brand_new_option=2)
    assert sum("brand_new_option" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("prompt", ["text", [1, 2], ["a", "b"], [[1], [2, 3]]])
def test_prompt_forms(prompt: Any) -> None:
    assert CompletionRequest(prompt=prompt).prompt == prompt


def test_float_token_ids_are_a_400_naming_prompt() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest(prompt=[1.5, 2])
    assert from_validation_error(info.value).param.startswith("prompt")


def test_sampling_fields_map_to_sampling_params() -> None:
    p = _completion(
        temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, stop="###", stop_token_ids=[2],
        ignore_eos=True, min_tokens=2, logprobs=3,
    )  # fmt: skip
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.5, 0.9, 5, 0.1, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.stop == ["###"] and p.stop_token_ids == [2] and p.ignore_eos and p.min_tokens == 2
    assert p.logprobs == 3 and p.max_tokens == 16
    assert p.output_kind == RequestOutputKind.FINAL_ONLY
    assert _completion(stream=True).output_kind == RequestOutputKind.DELTA


def test_unset_fields_take_the_model_defaults() -> None:
    defaults = SamplingParams(temperature=0.3, top_k=20)
    p = completion_sampling_params(CompletionRequest(prompt=[1]), 8, defaults)
    assert (p.temperature, p.top_k) == (0.3, 20)


def test_out_of_range_value_is_a_400_naming_the_field() -> None:
    with pytest.raises(APIError) as info:
        _completion(top_p=1.5)
    assert info.value.status == 400 and info.value.param == "top_p"


def test_chat_logprobs_and_max_completion_tokens() -> None:
    req = ChatCompletionRequest(messages=[], logprobs=True, top_logprobs=4)
    assert chat_sampling_params(req, 9, DEFAULTS, "max_tokens").logprobs == 4
    plain = ChatCompletionRequest(messages=[], logprobs=True)
    assert chat_sampling_params(plain, 9, DEFAULTS, "max_tokens").logprobs == 0
    with pytest.raises(APIError) as info:
        chat_sampling_params(
            ChatCompletionRequest(messages=[], top_logprobs=2), 9, DEFAULTS, "max_tokens"
        )
    assert info.value.param == "top_logprobs"
    with pytest.raises(APIError) as info:
        chat_sampling_params(
            ChatCompletionRequest(messages=[], logprobs=True, top_logprobs=-3), 9, DEFAULTS, "x"
        )
    assert info.value.param == "top_logprobs"


def test_max_tokens_budget_against_max_model_len() -> None:
    assert max_tokens_for(None, 10, 64, DEFAULTS, "max_tokens") == 54
    assert max_tokens_for(5, 10, 64, DEFAULTS, "max_tokens") == 5
    with pytest.raises(APIError) as info:
        max_tokens_for(60, 10, 64, DEFAULTS, "max_completion_tokens")
    assert info.value.param == "max_completion_tokens"
    with pytest.raises(APIError) as info:
        max_tokens_for(1, 64, 64, DEFAULTS, "max_tokens")
    assert info.value.param == "prompt"


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "json"),
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar"),
        ({"guided_json": SCHEMA}, "json"),
    ],
)
def test_output_constraints(body: dict, kind: str) -> None:
    assert _completion(**body).structured_outputs.kind == kind


def test_stream_options_need_stream() -> None:
    with pytest.raises(APIError) as info:
        _completion(stream_options={"include_usage": True})
    assert info.value.param == "stream_options"


def test_chunked_body_over_the_limit_is_413() -> None:
    app = build_app(FakeEngine(), ServerSettings(["fake"], max_request_body_bytes=1000))
    with TestClient(app) as c:
        chunks = iter([b'{"prompt": "', b"x" * 2000, b'"}'])
        r = c.post("/v1/completions", content=chunks)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_text_response_format_is_unconstrained() -> None:
    assert _completion(response_format={"type": "text"}).structured_outputs is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"nonsense": 1}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ],
)
def test_bad_output_constraint_is_a_400(body: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        _completion(**body)
    assert info.value.status == 400 and info.value.param == param


def test_engine_errors_as_http_errors() -> None:
    full = from_exception(QueueFullError("full", retry_after_s=2.5))
    assert full.status == 429 and full.headers["Retry-After"] == "3"
    dead = from_exception(EngineDeadError("gone"))
    assert dead.status == 500 and dead.body()["error"]["type"] == "EngineDeadError"
    value = from_exception(ValueError("request r-0: prompt: 9 tokens is too long"))
    assert value.status == 400 and value.param == "prompt"


def test_budget() -> None:
    assert plan_budget(1, None, cores=16).worker_threads == 15
    assert plan_budget(4, None, cores=16).worker_threads == 3
    assert plan_budget(3, 5, cores=16).compute_threads == 16
    with pytest.raises(BudgetError, match=r"--worker-threads 4 with --data-parallel-size 4"):
        plan_budget(4, 4, cores=16)
    line = plan_budget(2, None, cores=9).line()
    assert "engine core x 2" in line and "1 + 2*4 = 9 <= 9 cores" in line
    with pytest.raises(BudgetError, match=r"--data-parallel-size 2: .* 3 compute threads exceed"):
        plan_budget(2, None, cores=2)
    assert plan_budget(1, None, cores=1).worker_threads == 1  # the least there is


def test_budget_error_exits_2_before_starting_an_engine() -> None:
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "scripted", "--worker-threads", "999"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--worker-threads 999" in done.stderr


def _collect(chunks: AsyncIterator[str]) -> list[str]:
    async def run() -> list[str]:
        return [e async for e in framed(chunks)]

    return asyncio.run(run())


def test_sse_framing_and_error_event() -> None:
    async def good() -> AsyncIterator[str]:
        yield '{"a": 1}'

    async def dying() -> AsyncIterator[str]:
        yield '{"a": 1}'
        raise EngineDeadError("engine core 0 died")

    assert _collect(good()) == ['data: {"a": 1}\n\n', "data: [DONE]\n\n"]
    first, error, done = _collect(dying())
    assert json.loads(error[6:])["error"]["type"] == "EngineDeadError"
    assert done == "data: [DONE]\n\n"


# Chat, tokenize and health on a fake engine ---------------------------------------------


class FakeTokenizer:
    chat_template = "role: content"

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def apply_chat_template(self, conversation: list, **kwargs: Any) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in conversation)
        return text + ("<assistant>" if kwargs.get("add_generation_prompt") else "")

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]


class FakeEngine:
    """Answers every prompt with the words "Hel", "lo", "!" (token ids 72, 108, 33)."""

    WORDS = [("Hel", 72), ("lo", 108), ("!", 33)]

    def __init__(self, die_after: int | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = 256
        self.dead_error: str | None = None
        self.die_after = die_after

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams()

    def is_healthy(self) -> bool:
        return self.dead_error is None

    def _out(self, j: int, steps: list[int], done: bool, params: SamplingParams) -> Any:
        words = [self.WORDS[s] for s in steps]
        lps = [{t: Logprob(-0.1, 1, w), 99: Logprob(-2.5, 2, "c")} for w, t in words]
        return CompletionOutput(
            index=j,
            text="".join(w for w, _ in words),
            token_ids=[t for _, t in words],
            finish_reason="stop" if done else None,
            logprobs=lps if params.logprobs is not None else None,
        )

    async def generate(
        self, prompt: dict, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        ids = prompt["prompt_token_ids"]
        steps = range(min(params.max_tokens, len(self.WORDS)))

        def output(outs: list, done: bool) -> RequestOutput:
            return RequestOutput(request_id, prompt["prompt"], ids, outs, done, RequestMetrics(0))

        for s in steps:
            await asyncio.sleep(0)
            if self.die_after == s:
                raise EngineDeadError("engine core 0 died")
            done = s == len(steps) - 1
            if params.output_kind == RequestOutputKind.DELTA:
                yield output([self._out(j, [s], done, params) for j in range(params.n)], done)
        if params.output_kind != RequestOutputKind.DELTA:
            yield output([self._out(j, list(steps), True, params) for j in range(params.n)], True)


def _client(engine: FakeEngine) -> TestClient:
    return TestClient(build_app(engine, ServerSettings(served_model_names=["fake"])))


CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_completion_message_usage_and_logprobs() -> None:
    with _client(FakeEngine()) as c:
        body = {**CHAT, "logprobs": True, "top_logprobs": 2}
        out = c.post("/v1/chat/completions", json=body).json()
    choice = out["choices"][0]
    assert out["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": "Hello!", "tool_calls": []}
    assert choice["finish_reason"] == "stop"
    first = choice["logprobs"]["content"][0]
    assert first["token"] == "Hel" and first["bytes"] == list(b"Hel")
    assert [t["token"] for t in first["top_logprobs"]] == ["Hel", "c"]
    prompt_len = len("<user>hi<assistant>")
    assert out["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 3,
                            "total_tokens": prompt_len + 3}  # fmt: skip


def test_chat_stream_role_first_then_deltas_then_usage() -> None:
    body = {**CHAT, "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    with _client(FakeEngine()) as c:
        r = c.post("/v1/chat/completions", json=body)
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert [ch["choices"][0]["delta"] for ch in chunks[:2]] == [
        {"role": "assistant", "content": ""}
    ] * 2
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    content = [ch["choices"][0] for ch in chunks[2:-1]]
    assert "".join(c["delta"]["content"] for c in content if c["index"] == 0) == "Hello!"
    assert [c["finish_reason"] for c in content if c["index"] == 1] == [None, None, "stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_chat_engine_death_midstream_is_an_error_event_and_500_otherwise() -> None:
    with _client(FakeEngine(die_after=1)) as c:
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        plain = c.post("/v1/chat/completions", json=CHAT)
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["type"] == "EngineDeadError"
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "EngineDeadError"


def test_completion_text_prompt_and_echo() -> None:
    """With echo and logprobs the prompt's tokens come first (as vLLM); the fake engine
    computes no prompt logprobs, so theirs are null."""
    with _client(FakeEngine()) as c:
        body = {"prompt": "Say: ", "echo": True, "logprobs": 1}
        out = c.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    assert choice["text"] == "Say: Hello!" and "token_ids" not in choice or not choice["token_ids"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["\x01", "S", "a", "y", ":", " ", "Hel", "lo", "!"]
    assert logprobs["token_logprobs"][:6] == [None] * 6 and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"] == [0, 1, 2, 3, 4, 5, 6, 9, 11]


def test_tokenize_and_detokenize() -> None:
    with _client(FakeEngine()) as c:
        tok = c.post("/tokenize", json={"prompt": "ab"}).json()
        chat = c.post("/tokenize", json={"messages": CHAT["messages"]}).json()
        detok = c.post("/detokenize", json={"tokens": [104, 105]}).json()
    assert tok == {"count": 3, "max_model_len": 256, "tokens": [1, 97, 98], "token_strs": None}
    assert chat["count"] == len("<user>hi<assistant>")
    assert detok == {"prompt": "hi"}


def test_health_is_503_once_the_engine_died() -> None:
    engine = FakeEngine()
    with _client(engine) as c:
        assert c.get("/health").status_code == 200
        engine.dead_error = "engine core 0 died"
        assert c.get("/health").status_code == 503
