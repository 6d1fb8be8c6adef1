"""Greedy parity: tandem's paged runner against transformers' `generate()`, token for token.

Tiny random Llama / Qwen2 / Qwen3 models, under sync and async scheduling, for: one
request; 16 concurrent requests of mixed lengths; chunked prefill; preemption by a tiny
KV pool; prefix caching with shared prefixes. Then the embedded SmolLM2 on three chats.
The reference (`hf_greedy`) asserts the top-2 logit gap at every step, so a mismatch here
is a runner bug, not fp noise.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tandem.llm import LLM
from tandem.schema.sampling_params import SamplingParams
from tandem.testing.tiny_model import TINY_ARCHS, TINY_VOCAB

ASYNC = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
ARCHS = [pytest.param(a, id=a) for a in TINY_ARCHS]

MIXED_LENGTHS = [1, 60, 7, 33, 2, 48, 15, 22, 5, 41, 11, 57, 3, 29, 19, 36]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


def single_workload() -> list[tuple[list[int], int]]:
    return [(_ids(random.Random(11), 12), 24)]


def mixed_workload() -> list[tuple[list[int], int]]:
    """16 requests: prompt lengths 1..60, max_tokens 8..24."""
    rng = random.Random(1234)
    return [(_ids(rng, n), 8 + (i * 7) % 17) for i, n in enumerate(MIXED_LENGTHS)]


def prefix_workload() -> tuple[list[tuple[list[int], int]], list[tuple[list[int], int]]]:
    """(warm-up, then requests sharing its prefix): two shared prefixes, suffixes of 0..9."""
    rng = random.Random(99)
    prefix_a, prefix_b = _ids(rng, 37), _ids(rng, 21)
    warm = [(prefix_a + _ids(rng, 3), 10), (prefix_b + _ids(rng, 2), 10)]
    rest = []
    for i in range(8):
        prefix = prefix_a if i % 2 == 0 else prefix_b
        rest.append((prefix + _ids(rng, i + 1), 8 + i))
    rest.append((list(prefix_a), 9))  # the prefix alone: its last token is never a hit
    rest.append((list(warm[0][0]), 6))  # an exact repeat of a finished prompt
    return warm, rest


def make_llm(model_dir: Path, async_scheduling: bool, **overrides: Any) -> LLM:
    settings: dict[str, Any] = {
        "max_model_len": 128,
        "num_kv_blocks": 256,
        "block_size": 4,
        "enable_prefix_caching": False,
        "check_invariants": True,
        "async_scheduling": async_scheduling,
    }
    settings.update(overrides)
    llm = LLM(model=str(model_dir), **settings)
    assert llm.config.scheduler.async_scheduling is async_scheduling
    assert llm.tokenizer is None
    return llm


def run_greedy(llm: LLM, workload: list[tuple[list[int], int]]) -> list[list[int]]:
    prompts = [p for p, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    outs = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outs] == prompts
    for out, (_, n) in zip(outs, workload, strict=True):
        assert out.finished
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == n
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_parity(
    got: list[list[int]], workload: list[tuple[list[int], int]], model_dir: Path, hf_greedy
) -> None:
    for i, ((prompt, n), tokens) in enumerate(zip(workload, got, strict=True)):
        expected = hf_greedy(model_dir, prompt, n)
        assert tokens == expected, (
            f"request {i} (prompt len {len(prompt)}, max_tokens {n}): tandem {tokens} != "
            f"transformers {expected}; first difference at output index "
            f"{next(j for j, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b)}"
        )


def scheduler_of(llm: LLM) -> Any:
    return llm.engine.plugin_manager.plugins_with_role("scheduler")[0]


@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("arch", ARCHS)
def test_single_request(arch: str, async_scheduling: bool, tiny_models, hf_greedy) -> None:
    model_dir = tiny_models[arch]
    llm = make_llm(model_dir, async_scheduling)
    workload = single_workload()
    assert_parity(run_greedy(llm, workload), workload, model_dir, hf_greedy)


@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_mixed_lengths(
    arch: str, async_scheduling: bool, tiny_models, hf_greedy
) -> None:
    model_dir = tiny_models[arch]
    llm = make_llm(model_dir, async_scheduling, max_num_batched_tokens=1024, max_num_seqs=16)
    workload = mixed_workload()
    assert_parity(run_greedy(llm, workload), workload, model_dir, hf_greedy)


@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill(arch: str, async_scheduling: bool, tiny_models, hf_greedy) -> None:
    model_dir = tiny_models[arch]
    llm = make_llm(model_dir, async_scheduling, max_num_batched_tokens=16, max_num_seqs=16)
    workload = mixed_workload()
    assert_parity(run_greedy(llm, workload), workload, model_dir, hf_greedy)
    # Prompts up to 60 tokens with a 16-token budget: chunking must have happened.
    assert max(len(p) for p, _ in workload) > 16


@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_small_kv_pool(
    arch: str, async_scheduling: bool, tiny_models, hf_greedy
) -> None:
    model_dir = tiny_models[arch]
    # max_model_len 128 at block_size 4 needs 32 blocks; the pool has 34 (136 tokens) for
    # 16 requests of up to 84 tokens each.
    llm = make_llm(
        model_dir,
        async_scheduling,
        num_kv_blocks=34,
        block_size=4,
        max_model_len=128,
        max_num_batched_tokens=256,
        max_num_seqs=16,
    )
    workload = mixed_workload()
    assert_parity(run_greedy(llm, workload), workload, model_dir, hf_greedy)
    assert scheduler_of(llm).num_preemptions > 0


@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching_shared_prefixes(
    arch: str, async_scheduling: bool, tiny_models, hf_greedy
) -> None:
    model_dir = tiny_models[arch]
    llm = make_llm(model_dir, async_scheduling, enable_prefix_caching=True, max_num_seqs=16)
    warm, rest = prefix_workload()
    assert_parity(run_greedy(llm, warm), warm, model_dir, hf_greedy)
    kv = scheduler_of(llm).kv_cache_manager
    hits_before = kv.prefix_cache_hits
    assert_parity(run_greedy(llm, rest), rest, model_dir, hf_greedy)
    assert kv.prefix_cache_hits > hits_before > -1
    assert kv.prefix_cache_hits > 0


@pytest.mark.parametrize("attention", ["auto", "torch"])
@pytest.mark.parametrize("async_scheduling", ASYNC)
@pytest.mark.parametrize("arch", ARCHS)
def test_everything_at_once(
    arch: str, async_scheduling: bool, attention: str, tiny_models, hf_greedy
) -> None:
    """Prefix caching, chunked prefill and preemption together, on shared-prefix prompts
    mixed with the 16-request workload; with the compiled CPU decode kernel (auto) and
    with torch SDPA for decodes."""
    model_dir = tiny_models[arch]
    llm = make_llm(
        model_dir,
        async_scheduling,
        enable_prefix_caching=True,
        max_num_batched_tokens=16,
        num_kv_blocks=36,
        max_num_seqs=16,
        attention=attention,
    )
    model = llm.engine.executor.worker.model
    # the compiled decode kernel is a CPU kernel: on a GPU, auto means SDPA too
    assert (model.decode_kernel is not None) == (attention == "auto" and model.device.type == "cpu")
    warm, rest = prefix_workload()
    assert_parity(run_greedy(llm, warm), warm, model_dir, hf_greedy)
    workload = rest + mixed_workload()
    assert_parity(run_greedy(llm, workload), workload, model_dir, hf_greedy)
    scheduler = scheduler_of(llm)
    assert scheduler.num_preemptions > 0
    assert scheduler.kv_cache_manager.prefix_cache_hits > 0


@pytest.mark.parametrize("async_scheduling", ASYNC)
def test_n_greedy_sequences_share_the_prompt(
    async_scheduling: bool, tiny_models, hf_greedy
) -> None:
    model_dir = tiny_models["qwen2"]
    llm = make_llm(model_dir, async_scheduling, enable_prefix_caching=True)
    prompt, n = single_workload()[0]
    out = llm.generate(
        [prompt], SamplingParams(n=3, temperature=0.0, max_tokens=n, ignore_eos=True)
    )
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    expected = hf_greedy(model_dir, prompt, n)
    assert [list(c.token_ids) for c in out[0].outputs] == [expected] * 3


# The embedded SmolLM2 ------------------------------------------------------------------
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a long poem about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers."},
    ],
]


def test_smollm2_chat_matches_transformers(smollm2_llm, smollm2_dir, hf_reference) -> None:
    llm = smollm2_llm
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.chat(CHATS, params)
    assert len(outs) == len(CHATS)
    for chat, out in zip(CHATS, outs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == 16
        expected, gap = hf_reference.greedy_with_gap(smollm2_dir, out.prompt_token_ids, 16)
        # A real model can have near-ties; the chats were chosen where it does not.
        assert gap >= 1e-3, f"reference top-2 gap {gap:.3g} too small for {chat}"
        assert tokens == expected, f"{chat}: tandem {tokens} != transformers {expected}"
        text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
        assert out.outputs[0].text == text
