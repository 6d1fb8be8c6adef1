"""N-gram speculation on the embedded SmolLM2: greedy outputs equal the engine without
speculation, sync and async, with chunked prefill, preemption (a KV pool too small for the
batch), max_tokens reached inside a multi-token step and a stop string inside one.

The prompts ask the model to repeat a passage, which it does verbatim, so the n-gram
drafter's drafts are mostly accepted. One reference engine without speculation (large
budget and pool) gives the expected outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.core.outputs import EngineCoreOutput
from tandem.schema.outputs import RequestOutput

PASSAGE = (
    "The old lighthouse stood on the rocky cliff above the harbour. Every night its keeper "
    "climbed the spiral stairs, trimmed the wick and polished the great lens, so that the "
    "fishing boats could find their way home through the fog."
)
PROMPTS = [
    f"Repeat the following passage word for word.\nPassage: {PASSAGE}\nRepeated passage: ",
    f"Here is a sentence: {PASSAGE}\nHere is the same sentence again: ",
    f"Copy this text.\nText: {PASSAGE}\nCopy: ",
    f"Read this aloud twice: {PASSAGE}\nOnce more: ",
]
STOP = "fishing boats"
PARAMS = [
    SamplingParams(temperature=0, max_tokens=37),
    SamplingParams(temperature=0, max_tokens=64, stop=[STOP]),
    SamplingParams(temperature=0, max_tokens=53),
    SamplingParams(temperature=0, max_tokens=45),
]
COMMON: dict[str, Any] = {"model": "default", "dtype": "float32", "block_size": 16}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}


def result(out: RequestOutput) -> tuple[list[int], str, str | None]:
    c = out.outputs[0]
    return list(c.token_ids), c.text, c.finish_reason


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> list[tuple[list[int], str, str | None]]:
    llm = LLM(**COMMON, num_kv_blocks=96, max_model_len=1024, async_scheduling=False)
    try:
        outs = [result(o) for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.shutdown()
    assert outs[1][2] == "stop" and STOP not in outs[1][1]
    assert PASSAGE[:40] in outs[0][1]  # the model repeats: drafts can be accepted
    return outs


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def spec_llm(request: pytest.FixtureRequest, smollm2_dir: Path) -> Iterator[LLM]:
    """Chunked prefill (budget 32) and a pool of 16 blocks (256 tokens) for four requests
    of ~110 tokens each: some must be preempted."""
    llm = LLM(
        **COMMON,
        num_kv_blocks=16,
        max_model_len=256,
        max_num_batched_tokens=32,
        async_scheduling=request.param,
        speculative_config=SPEC,
        check_invariants=True,
    )
    assert llm.config.scheduler.async_scheduling is request.param
    yield llm
    llm.shutdown()


def test_ngram_greedy_equals_no_speculation(
    spec_llm: LLM, reference: list[tuple[list[int], str, str | None]]
) -> None:
    chunks: dict[str, list[list[int]]] = {}
    process = spec_llm.output_processor.process

    def recording(outputs: list[EngineCoreOutput]) -> Any:
        for out in outputs:
            if out.new_token_ids:
                chunks.setdefault(out.request_id, []).append(list(out.new_token_ids))
        return process(outputs)

    spec_llm.output_processor.process = recording  # type: ignore[method-assign]
    outs = spec_llm.generate(PROMPTS, PARAMS)
    assert [result(o) for o in outs] == reference

    scheduler = spec_llm.engine.plugin_manager.plugins_with_role("scheduler")[0]
    metrics = scheduler.spec_metrics
    assert metrics.num_accepted_tokens > metrics.num_steps  # > 1 accepted per step
    assert scheduler.num_preemptions > 0
    kv = scheduler.kv_cache_manager
    assert kv.all_blocks_free(), f"KV leak: {kv.num_free_blocks} of {kv.num_blocks} free"
    ids = [o.request_id for o in outs]
    # max_tokens reached by a step that returned several tokens (accepted drafts).
    assert len(chunks[ids[0]][-1]) >= 2 and len(outs[0].outputs[0].token_ids) == 37
    # The stop string arrived inside a multi-token step; the tokens after it were dropped.
    received = sum(len(c) for c in chunks[ids[1]])
    assert len(chunks[ids[1]][-1]) >= 2 and received > len(outs[1].outputs[0].token_ids)
