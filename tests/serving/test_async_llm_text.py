"""AsyncLLM on the tiny Llama with a word-level tokenizer: text prompts, detokenised
streams and stop strings applied in the front-end process, equal to `LLM.generate`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem import LLM
from tandem.engine import AsyncLLM
from tandem.schema.sampling_params import RequestOutputKind, SamplingParams
from tandem.testing.tiny_model import save_tiny_model, save_tiny_tokenizer

PROMPTS = ["hello world", "the capital of France is", "a cat", "Paris is the capital of"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-chat-llama")
    save_tiny_model("llama", directory)
    save_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def llm(chat_model: Path) -> Iterator[LLM]:
    engine = LLM(model=str(chat_model), worker_num_threads=1)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def engine(chat_model: Path) -> Iterator[AsyncLLM]:
    eng = AsyncLLM(model=str(chat_model), worker_num_threads=1)
    yield eng
    eng.shutdown()


async def stream_text(eng: AsyncLLM, prompt: str, params: SamplingParams, rid: str) -> tuple:
    text, tokens, finish = "", [], None
    async for out in eng.generate(prompt, params, rid):
        text += out.outputs[0].text
        tokens += out.outputs[0].token_ids
        finish = out.outputs[0].finish_reason
    return text, tokens, finish


def test_streamed_text_equals_llm_generate(engine: AsyncLLM, llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = llm.generate(PROMPTS, params, use_tqdm=False)
    delta = params.model_copy(update={"output_kind": RequestOutputKind.DELTA})

    async def main() -> list[tuple]:
        runs = [stream_text(engine, p, delta, f"t{i}") for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*runs)

    for (text, tokens, finish), ref in zip(asyncio.run(main()), reference, strict=True):
        assert (text, tokens, finish) == (
            ref.outputs[0].text,
            ref.outputs[0].token_ids,
            ref.outputs[0].finish_reason,
        )
        assert text  # the tokenizer turned tokens into words


def test_stop_string_ends_the_stream_like_llm(engine: AsyncLLM, llm: LLM) -> None:
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    words = free[0].outputs[0].text.split()
    assert len(words) >= 4
    stop = words[3]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[stop])
    reference = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    delta = params.model_copy(update={"output_kind": RequestOutputKind.DELTA})
    text, tokens, finish = asyncio.run(stream_text(engine, PROMPTS[0], delta, "stop"))
    assert (text, tokens, finish) == (reference.text, reference.token_ids, "stop")
    assert stop not in text and len(tokens) < 10
