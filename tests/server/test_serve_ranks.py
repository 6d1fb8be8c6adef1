"""`tandem serve` (and so `AsyncLLM`) with tensor-parallel ranks: the budget line counts
every rank's threads, streamed and plain completions equal one rank's `LLM.generate`
token for token, and /health and /metrics answer while the ranks run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from e2e_helpers import ServerProcess, running_server, token_ids

from tandem import LLM, SamplingParams
from tandem.testing.tiny_model import save_tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 50))]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("serve-ranks") / "llama")


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[ServerProcess]:
    flags = ("--tensor-parallel-size", "2", "--max-model-len", "128", "--served-model-name", "tiny")
    with running_server(str(tiny_llama), *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(model=str(tiny_llama), worker_num_threads=1, max_model_len=128)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()


def test_the_budget_line_counts_every_rank(server: ServerProcess) -> None:
    assert "2 rank workers per engine (tensor x pipeline parallel)" in server.log()


def test_completions_on_two_ranks_equal_one_rank(
    server: ServerProcess, reference: list[list[int]]
) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        plain = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert token_ids(plain.choices[0]) == expected
        streamed: list[int] = []
        for chunk in client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices:
                streamed += token_ids(chunk.choices[0])
        assert streamed == expected
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert "tandem" in httpx.get(f"{server.url}/metrics", timeout=10).text
