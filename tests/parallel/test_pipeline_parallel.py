"""Pipeline parallelism on the `mp` executor: the layers run as two stages (processes, gloo
point to point), the last stage samples and sends the ids back; under async scheduling the
batch queue holds pp_size + 1 steps, the decode stagger keeps a request out of the step
after its decode, and both stages compute at the same time. Tokens equal one rank's, with
tensor parallelism inside the stages too."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.schema.config import ConfigError
from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.testing.engine import make_request
from tests.parallel.tight_workload import GREEDY, TIGHT

SHARED = list(range(100, 124))
PROMPTS = [
    [5, 6, 7, 8, 9],
    [11, 12, 13],
    list(range(20, 61)),
    SHARED + [7, 7, 7],
    SHARED + [9, 8, 7, 6, 5],
]


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _scheduler(llm: LLM) -> Any:
    return llm.engine.plugin_manager.plugins_with_role("scheduler")[0]


def _pair(model_dir: Path, closing: list[LLM], tp: int = 1, **kw: Any) -> tuple[LLM, LLM]:
    one = LLM(model=str(model_dir), worker_num_threads=1, **kw)
    staged = LLM(model=str(model_dir), pipeline_parallel_size=2, tensor_parallel_size=tp, **kw)
    closing += [one, staged]
    return one, staged


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_stages_give_one_ranks_tokens(
    arch: str, async_scheduling: bool, tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    one, staged = _pair(tiny_dirs[arch], closing, async_scheduling=async_scheduling, **TIGHT)
    assert staged.config.max_concurrent_batches == (3 if async_scheduling else 2)
    expected = _tokens(one, GREEDY)
    assert _tokens(staged, GREEDY) == expected
    assert _tokens(staged, GREEDY) == expected  # again, through the prefix cache
    sched = staged.engine.plugin_manager.plugins_with_role("scheduler")[0]
    assert sched.num_preemptions > 0


def test_two_stages_of_two_ranks_each(tiny_dirs: dict[str, Path], closing: list[LLM]) -> None:
    one, staged = _pair(tiny_dirs["qwen2"], closing, tp=2, async_scheduling=True, **TIGHT)
    ranks = staged.engine.executor.collective_rpc("describe")
    assert [(r["tp_rank"], r["kv_heads"]) for r in ranks] == [(0, 1), (1, 1), (0, 1), (1, 1)]
    seeded = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    assert _tokens(staged, seeded) == _tokens(one, seeded)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ngram_drafts_under_two_stages(
    async_scheduling: bool, tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    """The last stage drafts and sends its proposals back with the sampled ids: stage 0
    embeds the same drafts, so the tokens are one rank's and drafts are accepted (the
    tiny Qwen3's greedy outputs repeat tokens, which one-token lookups catch)."""
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }
    tight = dict(TIGHT, max_model_len=96, num_kv_blocks=30)  # 40 tokens each: preempts
    one, staged = _pair(
        tiny_dirs["qwen3"],
        closing,
        speculative_config=spec,
        async_scheduling=async_scheduling,
        **tight,
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _tokens(staged, params) == _tokens(one, params)
    metrics = _scheduler(staged).spec_metrics.as_dict()
    assert metrics["num_accepted_tokens"] > 0, metrics
    assert _scheduler(staged).num_preemptions > 0


def test_a_grammar_under_two_stages_with_async_scheduling(
    tiny_chat_dir: Path, closing: list[LLM]
) -> None:
    plugins = ["reference-scheduler", "default-sampler", "structured-output"]
    one, staged = _pair(tiny_chat_dir, closing, plugins=plugins, async_scheduling=True)
    params = SamplingParams(
        temperature=0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["Paris", "cat", "hello"]),
    )
    prompts = ["the capital of France is", "hello world", "a cat"]
    expected = [o.outputs[0].text for o in one.generate(prompts, params)]
    assert [o.outputs[0].text for o in staged.generate(prompts, params)] == expected
    assert all(t in ("Paris", "cat", "hello") for t in expected)


def test_async_stages_overlap_with_pp_plus_one_steps_in_flight(
    tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    llm = LLM(model=str(tiny_dirs["llama"]), pipeline_parallel_size=2, async_scheduling=True)
    closing.append(llm)
    engine = llm.engine
    for i in range(8):
        engine.add_request(make_request(f"r{i}", [5 + i, 6, 7, 8], max_tokens=24, ignore_eos=True))
    in_flight: list[int] = []

    @contextmanager
    def blocking() -> Iterator[None]:  # the engine waits on the oldest step: the rest queued
        in_flight.append(len(engine.batch_queue) + 1)
        yield

    engine.wait_observer = blocking
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step_fn()
    assert not engine.has_unfinished_requests()
    assert max(in_flight) == 3  # pp_size + 1
    first, last = engine.executor.collective_rpc("step_spans")
    last_end = {step: end for step, _, end in last}
    overlapping = [
        step for step, start, _ in first if step - 1 in last_end and start < last_end[step - 1]
    ]
    # Stage 0 started step N + 1 before stage 1 finished step N, for most steps.
    assert len(overlapping) >= len(first) // 2, (len(overlapping), len(first))


def test_a_stage_partition_and_combinations_are_checked(tiny_dirs: dict[str, Path]) -> None:
    model = str(tiny_dirs["llama"])
    with pytest.raises(ConfigError, match=r"parallel\.pp_layer_partition: \[2, 0\]"):
        LLM(model=model, pipeline_parallel_size=2, pp_layer_partition=[2, 0])
    with pytest.raises(ConfigError, match=r"speculative\.method: 'eagle' .*pipeline_parallel"):
        LLM(
            model=model,
            pipeline_parallel_size=2,
            speculative_config={"method": "eagle", "num_speculative_tokens": 2},
        )
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size.*ScriptedModelLoader"):
        LLM(model="scripted", pipeline_parallel_size=2)


def test_a_dead_last_stage_is_named_and_the_engine_stops(
    tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    llm = LLM(model=str(tiny_dirs["llama"]), pipeline_parallel_size=2, async_scheduling=True)
    closing.append(llm)
    assert _tokens(llm, GREEDY)
    os.kill(llm.engine.executor.collective_rpc("describe")[1]["pid"], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(Exception, match=r"rank 1"):  # noqa: PT011 - the message is the contract
        for _ in range(3):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 120
