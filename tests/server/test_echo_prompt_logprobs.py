"""`prompt_logprobs` (vLLM's extra field) on /v1/completions and /v1/chat/completions, and
`echo` with `logprobs` on /v1/completions, against a live `tandem serve` on a tiny random
Llama with SmolLM2's tokenizer (one server for the module, 127.0.0.1), with the official
`openai` client.

The echoed prompt's tokens come first in `logprobs`, the first one with a null logprob;
their logprobs are the prompt logprobs the engine computed. A token-id prompt is echoed
detokenised (it used to echo nothing).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from e2e_helpers import ServerProcess, post, running_server, save_tiny_chat_model

MODEL = "tiny-echo"
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-echo"))
    with running_server(str(model_dir), "--served-model-name", MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60) as c:
        yield c


def complete(client: openai.OpenAI, **kw: Any) -> Any:
    extra = {"ignore_eos": True, **kw.pop("extra", {})}
    kw.setdefault("prompt", PROMPT)
    return client.completions.create(
        model=MODEL, max_tokens=5, temperature=0, extra_body=extra, **kw
    )


def prompt_ids(server: ServerProcess, text: str = PROMPT) -> list[int]:
    return post(server.url, "/tokenize", {"model": MODEL, "prompt": text}).json()["tokens"]


def close(got: list[float | None], want: list[float | None]) -> None:
    """Equal logprobs up to float noise (a prefix-cache hit or another chunking of the
    same prompt sums in another order)."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None) and (a is None or math.isclose(a, b, abs_tol=1e-4))


def extra(obj: Any, name: str) -> Any:
    value = (obj.model_extra or {}).get(name)
    assert value is not None, f"no {name} in {obj}"
    return value


def test_completions_prompt_logprobs_cover_every_prompt_token(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    ids = prompt_ids(server)
    choice = complete(client, extra={"prompt_logprobs": 2}).choices[0]
    entries = extra(choice, "prompt_logprobs")
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token_id) in entry  # the prompt token itself, besides the top 2
        assert 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2]
        for e in entry.values():
            assert e["logprob"] <= 0 and isinstance(e["decoded_token"], str)


def test_echo_with_logprobs_puts_the_prompt_tokens_first(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    ids = prompt_ids(server)
    plain = complete(client, logprobs=1).choices[0]
    echoed = complete(client, logprobs=1, echo=True, extra={"prompt_logprobs": 1}).choices[0]
    assert echoed.text == PROMPT + plain.text
    lp = echoed.logprobs
    assert lp is not None and plain.logprobs is not None
    num_prompt = len(ids)
    assert len(lp.tokens) == num_prompt + len(plain.logprobs.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.tokens[num_prompt:] == plain.logprobs.tokens
    close(lp.token_logprobs[num_prompt:], plain.logprobs.token_logprobs)
    assert "".join(lp.tokens[:num_prompt]) == PROMPT
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    entries = extra(echoed, "prompt_logprobs")
    for i in range(1, num_prompt):
        expected = entries[i][str(ids[i])]["logprob"]
        assert math.isclose(lp.token_logprobs[i], expected, abs_tol=1e-4)


def test_echo_with_logprobs_streamed_equals_not_streamed(client: openai.OpenAI) -> None:
    whole = complete(client, logprobs=1, echo=True).choices[0]
    text, tokens, values = "", [], []
    for chunk in complete(client, logprobs=1, echo=True, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
    assert whole.logprobs is not None
    assert text == whole.text and text.startswith(PROMPT)
    assert tokens == whole.logprobs.tokens
    close(values, whole.logprobs.token_logprobs)


def test_echo_of_a_token_id_prompt_is_the_detokenised_prompt(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    ids = prompt_ids(server)
    text = post(server.url, "/detokenize", {"model": MODEL, "tokens": ids}).json()["prompt"]
    assert text
    plain = complete(client, prompt=ids).choices[0]
    echoed = complete(client, prompt=ids, echo=True).choices[0]
    assert echoed.text == text + plain.text
    streamed = "".join(
        c.text
        for chunk in complete(client, prompt=ids, echo=True, stream=True)
        for c in chunk.choices
    )
    assert streamed == echoed.text
    with_lp = complete(client, prompt=ids, echo=True, logprobs=0).choices[0]
    assert with_lp.logprobs is not None and len(with_lp.logprobs.tokens) == len(ids) + 5


def test_chat_prompt_logprobs_cover_the_rendered_prompt(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_completion_tokens=3,
        temperature=0,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True},
    )
    entries = extra(out, "prompt_logprobs")
    ids = extra(out, "prompt_token_ids")
    assert out.usage is not None and len(entries) == len(ids) == out.usage.prompt_tokens
    assert entries[0] is None
    assert all(str(t) in e and len(e) <= 2 for t, e in zip(ids[1:], entries[1:], strict=True))


def test_prompt_logprobs_refused_when_streaming_or_too_many(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        list(complete(client, stream=True, extra={"prompt_logprobs": 1}))
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, extra={"prompt_logprobs": 10_000})
    assert "prompt_logprobs" in str(err.value)
