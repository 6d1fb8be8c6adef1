"""Tensor parallelism on the `mp` executor: two ranks (processes, gloo) give the tokens one
rank gives, for every tiny architecture, sync and async, with chunked prefill, preemption,
prefix caching, seeded sampling, n-gram drafts and a grammar; the ranks hold half the heads
each; bad sizes and combinations are refused naming the key; a dead rank is named and ends
the engine without a hang."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.schema.config import ConfigError
from tandem.schema.structured_outputs import StructuredOutputsParams
from tests.parallel.tight_workload import GREEDY, TIGHT

#: Prompts of 3..41 tokens; the last two share a 24-token prefix (prefix caching).
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


def _pair(model_dir: Path, closing: list[LLM], **kw: Any) -> tuple[LLM, LLM]:
    one = LLM(model=str(model_dir), worker_num_threads=1, **kw)
    two = LLM(model=str(model_dir), tensor_parallel_size=2, **kw)
    closing += [one, two]
    return one, two


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_give_one_ranks_greedy_tokens(
    arch: str, tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    one, two = _pair(tiny_dirs[arch], closing, async_scheduling=False, **TIGHT)
    assert two.config.parallel.executor == "mp"
    assert _tokens(two, GREEDY) == _tokens(one, GREEDY)
    assert _scheduler(one).num_preemptions > 0 and _scheduler(two).num_preemptions > 0


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_shards_give_one_ranks_tokens(
    mode: str, tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    """Each rank quantizes its own shard at load: rows of Q/K/V, gate/up and the LM head,
    whole groups of 32 columns of O and down, so the ranks hold exactly one rank's codes
    and scales, split."""
    one, two = _pair(tiny_dirs["llama"], closing, quantization=mode, **TIGHT)
    assert _tokens(two, GREEDY) == _tokens(one, GREEDY)
    described = two.engine.executor.collective_rpc("describe")
    assert [d["quantization"] for d in described] == [mode, mode]


def test_two_ranks_under_async_scheduling(tiny_dirs: dict[str, Path], closing: list[LLM]) -> None:
    one, two = _pair(tiny_dirs["llama"], closing, async_scheduling=True, **TIGHT)
    assert two.config.scheduler.async_scheduling is True
    assert two.config.max_concurrent_batches == 2
    assert _tokens(two, GREEDY) == _tokens(one, GREEDY)
    # The prefix cache served the shared prefix on the second pass.
    again = _tokens(two, GREEDY)
    assert again == _tokens(one, GREEDY)


def test_seeded_and_unseeded_sampling_and_the_ranks(
    tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    one, two = _pair(tiny_dirs["qwen3"], closing)
    seeded = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    assert _tokens(two, seeded) == _tokens(one, seeded)
    # Unseeded draws agree between the ranks (same seed, same calls): the run completes.
    free = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    assert [len(t) for t in _tokens(two, free)] == [12] * len(PROMPTS)
    ranks = two.engine.executor.collective_rpc("describe")
    assert [r["rank"] for r in ranks] == [0, 1] and [r["tp_rank"] for r in ranks] == [0, 1]
    assert len({r["pid"] for r in ranks}) == 2
    (whole,) = one.engine.executor.collective_rpc("describe")
    assert whole["kv_heads"] == 2 and [r["kv_heads"] for r in ranks] == [1, 1]


def test_ngram_drafts_under_two_ranks(tiny_dirs: dict[str, Path], closing: list[LLM]) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    one, two = _pair(tiny_dirs["llama"], closing, speculative_config=spec)
    repetitive = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert _tokens(two, repetitive) == _tokens(one, repetitive)


def test_eagle_drafts_under_two_ranks(
    tiny_dirs: dict[str, Path], closing: list[LLM], tmp_path: Path
) -> None:
    """EAGLE reads the target through its `DraftTarget`: the vocabulary-parallel embedding
    and the LM-head shards gathered. A head that memorised the target's continuations of
    some prompts gets drafts accepted; tokens and acceptance equal one rank's."""
    from tandem.testing.memorized_eagle_head import train_memorized_head

    rng = random.Random(21)
    prompts = [[rng.randrange(3, 300) for _ in range(8)] for _ in range(6)]
    head = train_memorized_head(tiny_dirs["llama"], prompts, 24, tmp_path / "head")
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(head)}
    one, two = _pair(tiny_dirs["llama"], closing, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in one.generate(prompts, params)]
    assert [list(o.outputs[0].token_ids) for o in two.generate(prompts, params)] == tokens
    metrics = _scheduler(two).spec_metrics.as_dict()
    assert metrics["num_accepted_tokens"] > 0, metrics
    assert metrics == _scheduler(one).spec_metrics.as_dict()


def test_a_draft_model_under_two_ranks(tiny_dirs: dict[str, Path], closing: list[LLM]) -> None:
    """The draft model is built on each rank like the target, so it is split the same way
    (its own shards and collectives); the target as its own drafter has every draft
    accepted, and the tokens are one rank's."""
    model = str(tiny_dirs["llama"])
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": model}
    one, two = _pair(tiny_dirs["llama"], closing, speculative_config=spec)
    assert _tokens(two, GREEDY) == _tokens(one, GREEDY)
    metrics = _scheduler(two).spec_metrics.as_dict()
    assert metrics["num_draft_tokens"] > 0
    assert metrics["num_accepted_tokens"] == metrics["num_draft_tokens"], metrics


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_a_grammar_under_two_ranks(backend: str, tiny_chat_dir: Path, closing: list[LLM]) -> None:
    plugins = ["reference-scheduler", "default-sampler", "structured-output"]
    one, two = _pair(tiny_chat_dir, closing, plugins=plugins)
    choice = StructuredOutputsParams(choice=["Paris", "cat", "hello"], backend=backend)
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice)
    texts_one = [o.outputs[0].text for o in one.generate(["the capital of France is"] * 2, params)]
    texts_two = [o.outputs[0].text for o in two.generate(["the capital of France is"] * 2, params)]
    assert texts_two == texts_one
    assert all(t in ("Paris", "cat", "hello") for t in texts_two), texts_two


def test_sizes_that_do_not_divide_are_refused_naming_the_key(tiny_dirs: dict[str, Path]) -> None:
    with pytest.raises(
        ConfigError, match=r"parallel\.tensor_parallel_size: 3 .*num_attention_heads"
    ):
        LLM(model=str(tiny_dirs["llama"]), tensor_parallel_size=3)


def test_kv_heads_that_neither_divide_nor_are_divided_by_tp_are_refused() -> None:
    from types import SimpleNamespace

    from tandem.models.tensor_parallel import check_divisible, kv_heads_per_rank, kv_split

    six_three = SimpleNamespace(num_attention_heads=6, num_key_value_heads=3, intermediate_size=96)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 2 .*num_key_value_heads \(3\)"):
        check_divisible(six_three, 2)
    mqa = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, intermediate_size=64)
    check_divisible(mqa, 4)  # replicated: ranks 0-1 keep KV head 0, ranks 2-3 KV head 1
    assert [kv_split(mqa, r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert kv_heads_per_rank(mqa, 4) == 1 and kv_heads_per_rank(mqa, 2) == 1


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (biased QKV) with one KV head for four query heads and a vocabulary of
    383 (divides by no rank count): KV replication and uneven vocabulary shards."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.testing.tiny_model import tiny_config

    config = tiny_config("qwen2")
    config.num_key_value_heads = 1
    config.vocab_size = 383
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(22)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    finally:
        torch.random.set_rng_state(state)
    directory = tmp_path_factory.mktemp("mqa") / "qwen2"
    model.save_pretrained(directory)
    return directory


def test_one_kv_head_replicated_on_two_ranks(mqa_dir: Path, closing: list[LLM]) -> None:
    one, two = _pair(mqa_dir, closing, async_scheduling=False, **TIGHT)
    assert [r["kv_heads"] for r in two.engine.executor.collective_rpc("describe")] == [1, 1]
    assert _tokens(two, GREEDY) == _tokens(one, GREEDY)
    assert _scheduler(two).num_preemptions > 0


def test_combinations_that_do_not_run_with_ranks_are_refused(tiny_dirs: dict[str, Path]) -> None:
    model = str(tiny_dirs["llama"])
    with pytest.raises(ConfigError, match=r"parallel\.executor 'process' runs at most 1"):
        LLM(model=model, tensor_parallel_size=2, executor="process")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size.*ScriptedModelLoader"):
        LLM(model="scripted", tensor_parallel_size=2)


def test_a_dead_rank_is_named_and_the_engine_stops(
    tiny_dirs: dict[str, Path], closing: list[LLM]
) -> None:
    llm = LLM(model=str(tiny_dirs["llama"]), tensor_parallel_size=2)
    closing.append(llm)
    assert _tokens(llm, GREEDY)  # running
    rank1 = llm.engine.executor.collective_rpc("describe")[1]["pid"]
    os.kill(rank1, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(Exception, match=r"rank 1"):  # noqa: PT011 - the message is the contract
        for _ in range(3):  # the kill lands between steps: a later step must fail
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 120


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "pp", "async_scheduling"),
    [(3, 1, False), (3, 1, True), (1, 2, True), (3, 2, True)],
    ids=["tp3-sync", "tp3-async", "pp2-async", "tp3xpp2-async"],
)
def test_smollm2_on_ranks_gives_one_ranks_tokens(
    tp: int, pp: int, async_scheduling: bool, closing: list[LLM]
) -> None:
    """SmolLM2-135M (9 heads, 3 KV heads: TP=3 is its only split) greedy, on ranks vs one,
    with chunked prefill (32-token budget), preemption (a 16-block pool) and the prefix
    cache (every prompt twice)."""
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(1000, 1060)), list(range(2000, 2040))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tight = dict(
        max_model_len=128,
        block_size=8,
        num_kv_blocks=16,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
    )
    one = LLM(model="default", worker_num_threads=1, **tight)
    ranks = LLM(model="default", tensor_parallel_size=tp, pipeline_parallel_size=pp, **tight)
    closing += [one, ranks]
    expected = [list(o.outputs[0].token_ids) for o in one.generate(prompts, params)]
    for _ in range(2):
        got = [list(o.outputs[0].token_ids) for o in ranks.generate(prompts, params)]
        assert got == expected
    assert _scheduler(ranks).num_preemptions > 0


def test_two_kv_heads_on_four_ranks(tiny_dirs: dict[str, Path], closing: list[LLM]) -> None:
    """4 query / 2 KV heads on 4 ranks: one query head each, each KV head on two ranks."""
    one = LLM(model=str(tiny_dirs["llama"]), worker_num_threads=1, **TIGHT)
    four = LLM(model=str(tiny_dirs["llama"]), tensor_parallel_size=4, worker_num_threads=1, **TIGHT)
    closing += [one, four]
    assert [r["kv_heads"] for r in four.engine.executor.collective_rpc("describe")] == [1] * 4
    assert _tokens(four, GREEDY) == _tokens(one, GREEDY)


def test_the_kv_budget_is_per_rank(tiny_dirs: dict[str, Path]) -> None:
    """`kv_cache_memory_gib` is each rank's: a rank holds its KV heads of its stage's layers,
    so TP=2 and PP=2 double the pool's blocks for the same budget (tiny: 2 layers, 2 KV heads
    of 16, float32: 256 bytes per token per layer per KV head pair)."""
    from tandem.config_resolution import resolve_config
    from tandem.stack_file import load_config

    def blocks(**kw: Any) -> int:
        config = load_config(
            None,
            model=str(tiny_dirs["llama"]),
            dtype="float32",
            kv_cache_memory_gib=1 / 1024,
            block_size=4,
            **kw,
        )
        return resolve_config(config).cache.num_kv_blocks

    one = blocks()
    assert one == (1 << 20) // (2 * 2 * 2 * 16 * 4 * 4)  # K+V, layers, heads, dim, fp32, block
    assert blocks(tensor_parallel_size=2) == 2 * one
    assert blocks(pipeline_parallel_size=2) == 2 * one
    assert blocks(tensor_parallel_size=4) == 2 * one  # replicated: one KV head per rank
