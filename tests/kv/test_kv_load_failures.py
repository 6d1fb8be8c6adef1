"""The specification's KV load-failure rule, end to end (../shared/reference/000_*, "KV 装载失败").

A test connector (`tandem.testing.kv_faults.FailingLoadsConnector`) claims one block past
the local prefix-cache hit for some requests, fills
it with garbage and reports its load failed. The scheduler must roll each such request back
to the block's start, drop the outputs of its steps in flight, remove the block from the
prefix cache and recompute: every request's tokens equal those of the same engine without
the connector, under sync and async scheduling, with n-gram drafts and with a grammar in
the same steps, and the requests without a failure are never disturbed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.testing.kv_faults import FailingLoadsConnector
from tandem.testing.tiny_model import save_tiny_model, save_tiny_tokenizer

BLOCK = 8


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("kv-fail") / "llama"
    save_tiny_model("llama", directory)
    save_tiny_tokenizer(directory)
    return directory


def _engine(model: Path, plugins: list[Any], **kw: Any) -> LLM:
    return LLM(
        model=str(model),
        block_size=BLOCK,
        max_model_len=128,
        executor="thread",
        worker_num_threads=1,
        plugins=plugins,
        **kw,
    )


def _scheduler(llm: LLM) -> Any:
    return llm.engine.plugin_manager.plugins_with_role("scheduler")[0]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    try:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        return [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


PROMPTS = [[(7 * i + 3 * j) % 90 + 5 for j in range(20 + 7 * i)] for i in range(6)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("drafts", [False, True])
def test_failed_loads_recompute_to_the_same_tokens(
    tiny_chat: Path, async_scheduling: bool, drafts: bool
) -> None:
    base = ["reference-scheduler", "default-sampler", *(["ngram-drafter"] if drafts else [])]
    victims = ["1", "3", "4"]  # LLM numbers requests 0.. in order
    failing = (FailingLoadsConnector, {"victims": victims})
    kw: dict[str, Any] = {"async_scheduling": async_scheduling}
    if drafts:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = _run(_engine(tiny_chat, base, **kw), PROMPTS, params)
    llm = _engine(tiny_chat, [*base, failing], **kw)
    stats = _scheduler(llm).kv_link.stats
    assert _run(llm, PROMPTS, params) == expected
    assert stats["failed_load_blocks"] == len(victims)
    assert stats["rolled_back_requests"] >= len(victims)
    assert stats["external_hit_tokens"] == BLOCK * len(victims)


def test_failed_loads_beside_a_grammar_under_async_scheduling(tiny_chat: Path) -> None:
    base = ["reference-scheduler", "default-sampler", "structured-output"]
    failing = (FailingLoadsConnector, {"victims": ["0", "2"]})
    choice = StructuredOutputsParams(choice=["Paris", "cat", "hello"])
    params = [
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice)
        if i % 2
        else SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    expected = _run(_engine(tiny_chat, base, async_scheduling=True), PROMPTS, params)  # type: ignore[arg-type]
    llm = _engine(tiny_chat, [*base, failing], async_scheduling=True)
    stats = _scheduler(llm).kv_link.stats
    assert _run(llm, PROMPTS, params) == expected  # type: ignore[arg-type]
    assert stats["failed_load_blocks"] == 2


def test_a_recomputed_block_serves_later_prefix_hits(tiny_chat: Path) -> None:
    """The failed block leaves the prefix cache and is cached again once recomputed: a
    later request with the victim's prompt hits it and gets the victim's tokens."""
    base = ["reference-scheduler", "default-sampler"]
    llm = _engine(tiny_chat, [*base, (FailingLoadsConnector, {"victims": ["0"]})])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS[5]}
    try:
        first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        again = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        kv = _scheduler(llm).kv_cache_manager
        assert kv.prefix_cache_hits > 0  # the second request did hit the recomputed blocks
    finally:
        llm.engine.shutdown()
    assert list(again) == list(first)
