"""The slow suite's end-to-end checks on the embedded SmolLM2 (`tandem serve default`):
64 concurrent greedy streams equal `LLM.generate` token for token, chat streaming and not,
n > 1, stop strings, and a JSON-schema `response_format` whose output validates.

Marked slow (`make test-slow`): a server and an in-process `LLM` on a 135M model. Both use
the same engine settings, so greedy outputs compare exactly.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from e2e_helpers import ServerProcess, running_server

pytestmark = pytest.mark.slow

MODEL = "default"
ENGINE = {"max_num_seqs": 64, "max_model_len": 1024, "block_size": 16}
NUM_CLIENTS = 64
MAX_TOKENS = 16
SUBJECTS = ("the sea", "a city", "music", "winter", "a robot", "bread", "the moon", "a river")
OPENINGS = ("Write one sentence about", "Tell me a fact about", "Describe", "A short poem on")


def text_prompts() -> list[str]:
    return [f"{OPENINGS[i % 4]} {SUBJECTS[(i // 4) % 8]} (#{i})." for i in range(NUM_CLIENTS)]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    with running_server(MODEL, *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    from tandem import LLM
    from tandem.schema.sampling_params import SamplingParams

    llm = LLM(model=MODEL, worker_num_threads=1, **ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(text_prompts(), params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


async def stream_ids(client: openai.AsyncOpenAI, prompt: str) -> list[int]:
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    tokens: list[int] = []
    async for chunk in stream:
        for choice in chunk.choices:
            tokens += (choice.model_extra or {})["token_ids"]
    return tokens


def test_64_streams_equal_llm_generate(server: ServerProcess, reference) -> None:
    async def main() -> list[list[int]]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="none", max_retries=0, timeout=600
        ) as client:
            runs = [stream_ids(client, p) for p in text_prompts()]
            return await asyncio.wait_for(asyncio.gather(*runs), timeout=900)

    assert asyncio.run(main()) == reference


def chat(client: openai.OpenAI, content: str, **kw: Any) -> Any:
    messages: Any = [{"role": "user", "content": content}]
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def test_chat_streaming_and_not(client: openai.OpenAI) -> None:
    whole = chat(client, "What is the capital of France?", max_tokens=24, temperature=0)
    text = whole.choices[0].message.content or ""
    assert whole.choices[0].message.role == "assistant" and "Paris" in text
    chunks = list(
        chat(client, "What is the capital of France?", max_tokens=24, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_chat_n_choices(client: openai.OpenAI) -> None:
    out = chat(client, "Name an animal.", max_tokens=8, n=3, temperature=0.8, seed=1)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.message.content for c in out.choices)


def test_stop_strings(client: openai.OpenAI) -> None:
    ask = "Count from 1 to 10, separated by commas."
    full = chat(client, ask, max_tokens=40, temperature=0).choices[0].message.content or ""
    assert "5" in full, full
    cut = chat(client, ask, max_tokens=40, temperature=0, stop=["5"]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.index("5")]


def test_json_schema_response_format_validates(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": False,
    }
    out = chat(
        client,
        "Invent a person: give their name, age and pets as JSON.",
        max_tokens=96,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), schema)
