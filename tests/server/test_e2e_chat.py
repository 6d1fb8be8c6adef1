"""Chat, text prompts and tokenizer routes against a live `tandem serve` process on a tiny
random Llama that carries the embedded SmolLM2's tokenizer and chat template (built in
seconds; see `e2e_helpers.save_tiny_chat_model`), with the official `openai` client:
chat streaming and not, n > 1, stop strings, chat logprobs, a JSON-schema
`response_format` whose output validates, /tokenize and /detokenize.

The model is random, so its text is gibberish; greedy decoding is deterministic, so the
tests compare routes with each other (chat == completions on the rendered prompt,
streamed == not streamed) and stop strings against the unstopped text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from e2e_helpers import ServerProcess, post, running_server, save_tiny_chat_model

MODEL = "tiny-chat"
MESSAGES: Any = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    flags = ["--served-model-name", MODEL, "--max-num-seqs", "8"]
    with running_server(str(model_dir), *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60) as c:
        yield c


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    extra = {"ignore_eos": True, **kw.pop("extra", {})}
    return client.chat.completions.create(
        model=MODEL, messages=kw.pop("messages", MESSAGES), extra_body=extra, **kw
    )


def extra(obj: Any, name: str) -> Any:
    value = (obj.model_extra or {}).get(name)
    assert value is not None, f"no {name} in {obj}"
    return value


def test_chat_not_streaming_equals_completions_on_the_rendered_prompt(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    out = chat(client, max_completion_tokens=12, temperature=0, extra={"return_token_ids": True})
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    rendered = post(server.url, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    assert extra(out, "prompt_token_ids") == rendered["tokens"]
    assert out.usage is not None and out.usage.prompt_tokens == rendered["count"]
    assert out.usage.completion_tokens == 12
    plain = client.completions.create(
        model=MODEL,
        prompt=rendered["tokens"],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert extra(plain.choices[0], "token_ids") == extra(choice, "token_ids")
    assert plain.choices[0].text == choice.message.content


def test_chat_streaming_equals_not_streaming(client: openai.OpenAI) -> None:
    whole = chat(client, max_tokens=10, temperature=0).choices[0].message.content
    stream = chat(
        client, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and not first.delta.content
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 10
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole
    reasons = [c.choices[0].finish_reason for c in content_chunks]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}


def test_chat_n_choices_are_indexed(client: openai.OpenAI) -> None:
    out = chat(client, max_tokens=6, n=3, temperature=1.0, seed=11)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage is not None and out.usage.completion_tokens == 18
    greedy = chat(client, max_tokens=6, temperature=0).choices[0].message.content
    texts: dict[int, str] = {}
    for chunk in chat(client, max_tokens=6, n=2, temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {0: greedy, 1: greedy}


def stop_string_in(text: str) -> tuple[str, int]:
    """A 2-character piece of `text` first found at k >= 2, not blank: (piece, k)."""
    for k in range(2, len(text) - 2):
        piece = text[k : k + 2]
        if piece.strip() and text.find(piece) == k:
            return piece, k
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_end_the_text(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 24, "temperature": 0}
    full = client.completions.create(
        prompt="Once upon a time", extra_body={"ignore_eos": True}, **kw
    )
    text = full.choices[0].text
    piece, k = stop_string_in(text)
    cut = client.completions.create(
        prompt="Once upon a time", stop=[piece], extra_body={"ignore_eos": True}, **kw
    )
    assert cut.choices[0].text == text[:k]
    assert cut.choices[0].finish_reason == "stop"
    assert extra(cut.choices[0], "stop_reason") == piece
    whole = chat(client, max_tokens=24, temperature=0).choices[0].message.content
    piece, k = stop_string_in(whole)
    stopped = chat(client, max_tokens=24, temperature=0, stop=piece).choices[0]
    assert stopped.message.content == whole[:k] and stopped.finish_reason == "stop"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = chat(client, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 5
    for entry in logprobs.content:
        assert isinstance(entry.token, str) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
    assert "".join(e.token for e in logprobs.content) == out.choices[0].message.content


def test_json_schema_response_format_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=48,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "colour", "schema": schema, "strict": True},
        },
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_tokenize_and_detokenize_round_trip(server: ServerProcess) -> None:
    text = "Hello world, tandem serves."
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False, "return_token_strs": True}
    tokens = post(server.url, "/tokenize", body).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 3
    assert tokens["max_model_len"] == 512
    back = post(server.url, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    bad = httpx.post(
        f"{server.url}/detokenize", json={"model": MODEL, "tokens": [10**9]}, timeout=10
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_structured_outputs_extra_body(client: openai.OpenAI) -> None:
    """vLLM's `structured_outputs` body (choice, regex) maps to the grammar plugin."""
    for _ in range(2):
        out = chat(
            client,
            max_tokens=16,
            temperature=1.0,
            extra={
                "structured_outputs": {"choice": ["alpha", "beta", "gamma"]},
                "ignore_eos": False,
            },
        )
        assert out.choices[0].message.content in ("alpha", "beta", "gamma")
    out = chat(
        client,
        max_tokens=16,
        temperature=0,
        extra={"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}, "ignore_eos": False},
    )
    content = out.choices[0].message.content or ""
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", content), content
