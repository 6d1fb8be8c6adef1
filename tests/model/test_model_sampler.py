"""The default sampler: seeds, distributions, penalties, min_tokens and bad words.

Unit tests call `DefaultSampler.sample` / `apply_penalties` on hand-built
`SamplingMetadata`; end-to-end tests run tiny random models (and SmolLM2 for string bad
words) through `LLM.generate`.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.core.worker.input_batch import RequestState
from tandem.core.worker.sampling_inputs import blocked_tokens
from tandem.core.worker.sampling_metadata import SamplingMetadata
from tandem.llm import LLM
from tandem.plugins.default_sampler import DefaultSampler, apply_penalties, greedy_tokens
from tandem.schema.sampling_params import SamplingParams
from tandem.stack_file import load_config
from tandem.testing.tiny_model import TINY_VOCAB

TINY_EOS = 2


def tiny_llm(model_dir: Path, **overrides: Any) -> LLM:
    settings: dict[str, Any] = {
        "max_model_len": 128,
        "num_kv_blocks": 256,
        "block_size": 4,
        "check_invariants": True,
        "async_scheduling": False,
    }
    settings.update(overrides)
    return LLM(model=str(model_dir), **settings)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


# (1) Seeded sampling: reproducible, independent of the batch and of async scheduling ----
SEEDED_PROMPT = _ids(5, 10)
SEEDED = SamplingParams(temperature=1.5, seed=1234, max_tokens=16, ignore_eos=True)


def _batch_around_seeded() -> tuple[list[list[int]], list[SamplingParams], int]:
    """8 other requests (greedy, unseeded, other seeds, filters) plus the seeded one at 5."""
    prompts, params = [], []
    for i in range(8):
        prompts.append(_ids(100 + i, 3 + 7 * i))
        if i % 4 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True))
        elif i % 4 == 1:
            params.append(SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
        elif i % 4 == 2:
            params.append(
                SamplingParams(temperature=0.7, top_k=20, seed=i, max_tokens=9, ignore_eos=True)
            )
        else:
            params.append(
                SamplingParams(
                    temperature=1.2, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True
                )
            )
    prompts.insert(5, SEEDED_PROMPT)
    params.insert(5, SEEDED)
    return prompts, params, 5


def _seeded_alone(model_dir: Path, **overrides: Any) -> list[int]:
    out = tiny_llm(model_dir, **overrides).generate([SEEDED_PROMPT], SEEDED)
    return list(out[0].outputs[0].token_ids)


def test_seeded_sampling_reproducible_across_instances(tiny_models) -> None:
    model_dir = tiny_models["llama"]
    first = _seeded_alone(model_dir)
    second = _seeded_alone(model_dir)
    assert len(first) == 16
    assert first == second
    # The draw is not trivially greedy, and another seed gives another sequence.
    greedy = tiny_llm(model_dir).generate(
        [SEEDED_PROMPT], SEEDED.model_copy(update={"temperature": 0.0})
    )[0]
    assert first != list(greedy.outputs[0].token_ids)
    other_seed = SEEDED.model_copy(update={"seed": 4321})
    other = tiny_llm(model_dir).generate([SEEDED_PROMPT], other_seed)[0]
    assert list(other.outputs[0].token_ids) != first


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"async_scheduling": False}, id="sync"),
        pytest.param({"async_scheduling": True}, id="async"),
        pytest.param({"async_scheduling": True, "max_num_batched_tokens": 8}, id="async-chunked"),
        pytest.param(
            {"async_scheduling": False, "num_kv_blocks": 34, "max_num_seqs": 16},
            id="sync-preempted",
        ),
    ],
)
def test_seeded_sampling_independent_of_batch(tiny_models, overrides) -> None:
    model_dir = tiny_models["llama"]
    alone_sync = _seeded_alone(model_dir, async_scheduling=False)
    alone_async = _seeded_alone(model_dir, async_scheduling=True)
    assert alone_sync == alone_async
    llm = tiny_llm(model_dir, **overrides)
    prompts, params, index = _batch_around_seeded()
    if "num_kv_blocks" in overrides:  # more load, so that the small pool preempts
        extra = [_ids(200 + i, 40) for i in range(8)]
        prompts += extra
        params += [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)] * len(extra)
    outs = llm.generate(prompts, params)
    assert list(outs[index].outputs[0].token_ids) == alone_sync
    # The other request with seed 1234 has other params and prompt: it must not matter.
    assert len(outs[3].outputs[0].token_ids) == 12
    if "num_kv_blocks" in overrides:
        assert llm.engine.plugin_manager.plugins_with_role("scheduler")[0].num_preemptions > 0


# (2) Empirical distributions of DefaultSampler.sample --------------------------------
LOGITS = torch.tensor([2.0, 1.2, 0.9, 0.5, 0.1, -0.3, -1.0, -2.5])
TEMPERATURE = 0.8
N_DRAWS = 40_000
#: Upper 1e-3 quantiles of chi-square with df = 1..7 degrees of freedom.
CHI2_CRIT_1E3 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
MAX_ABS_ERR = 0.01  # 4 standard deviations of a frequency at N = 40000


def make_sampler(seed: int = 0) -> DefaultSampler:
    return DefaultSampler(load_config(None, model="scripted", seed=seed), DefaultSampler.Options())


def make_metadata(
    rows: int,
    temperature: float | list[float] = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seeds: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    **extra: Any,
) -> SamplingMetadata:
    temps = (
        torch.tensor(temperature, dtype=torch.float32)
        if isinstance(temperature, list)
        else torch.full((rows,), temperature, dtype=torch.float32)
    )
    return SamplingMetadata(
        all_greedy=bool((temps == 0).all()),
        temperature=temps,
        top_k=torch.full((rows,), top_k, dtype=torch.int64),
        top_p=torch.full((rows,), top_p, dtype=torch.float32),
        min_p=torch.full((rows,), min_p, dtype=torch.float32),
        seeds=seeds if seeds is not None else torch.full((rows,), -1, dtype=torch.int64),
        output_positions=(
            positions if positions is not None else torch.zeros(rows, dtype=torch.int64)
        ),
        num_draft_tokens=[0] * rows,
        draft_token_ids=torch.zeros(0, dtype=torch.int64),
        **extra,
    )


def expected_probs(top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0) -> list[float]:
    """softmax(LOGITS / T) restricted to the top-k, then the top-p nucleus (smallest set of
    most likely tokens whose mass reaches p), then the min-p floor, renormalised."""
    scaled = [float(x) / TEMPERATURE for x in LOGITS]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order if top_k <= 0 else order[:top_k])

    def renorm(kept: set[int]) -> list[float]:
        z = sum(math.exp(scaled[i]) for i in kept)
        return [math.exp(scaled[i]) / z if i in kept else 0.0 for i in range(len(scaled))]

    probs = renorm(keep)
    if top_p < 1.0:
        mass, nucleus = 0.0, set()
        for i in order:
            if i in keep and mass < top_p:
                nucleus.add(i)
                mass += probs[i]
        keep = nucleus
        probs = renorm(keep)
    if min_p > 0.0:
        floor = max(probs) * min_p
        keep = {i for i in keep if probs[i] >= floor}
        probs = renorm(keep)
    return probs


FILTERS = [
    pytest.param({}, id="temperature"),
    pytest.param({"top_k": 3}, id="top_k"),
    pytest.param({"top_p": 0.7}, id="top_p"),
    pytest.param({"min_p": 0.15}, id="min_p"),
    pytest.param({"top_k": 5, "top_p": 0.85}, id="top_k+top_p"),
]
NOISE = ["unseeded", "distinct-seeds", "one-seed-many-positions"]


@pytest.mark.parametrize("noise", NOISE)
@pytest.mark.parametrize("filters", FILTERS)
def test_sample_distribution_matches_softmax(filters: dict, noise: str) -> None:
    n = N_DRAWS
    if noise == "unseeded":
        seeds, positions = None, None
    elif noise == "distinct-seeds":
        # Spread out seeds (adjacent seeds are covered by the independence test below).
        seeds = torch.arange(n, dtype=torch.int64) * 7919 + 12345
        positions = torch.arange(n, dtype=torch.int64) % 5
    else:
        seeds = torch.full((n,), 2024, dtype=torch.int64)
        positions = torch.arange(n, dtype=torch.int64)
    metadata = make_metadata(
        n, temperature=TEMPERATURE, seeds=seeds, positions=positions, **filters
    )
    logits = LOGITS.expand(n, -1).clone()
    out = make_sampler().sample(logits=logits, metadata=metadata).sampled_token_ids
    assert out.shape == (n, 1)
    counts = torch.bincount(out[:, 0], minlength=len(LOGITS)).tolist()
    expected = expected_probs(**filters)
    # Filtered-out tokens never appear.
    for token, p in enumerate(expected):
        if p == 0.0:
            assert counts[token] == 0, f"token {token} is filtered out but drawn {counts[token]}x"
    freqs = [c / n for c in counts]
    errors = [abs(f - p) for f, p in zip(freqs, expected, strict=True)]
    assert max(errors) <= MAX_ABS_ERR, f"freqs {freqs} vs expected {expected}"
    kept = [i for i, p in enumerate(expected) if p > 0]
    chi2 = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in kept)
    if len(kept) > 1:
        assert chi2 <= CHI2_CRIT_1E3[len(kept) - 1], f"chi2 {chi2:.1f} over {len(kept)} tokens"


def test_expected_probs_filters_are_not_trivial() -> None:
    """Guard for the test above: each filter keeps a strict, non-trivial subset."""
    assert sum(p > 0 for p in expected_probs()) == 8
    assert sum(p > 0 for p in expected_probs(top_k=3)) == 3
    assert 1 < sum(p > 0 for p in expected_probs(top_p=0.7)) < 8
    assert 1 < sum(p > 0 for p in expected_probs(min_p=0.15)) < 8
    assert 1 < sum(p > 0 for p in expected_probs(top_k=5, top_p=0.85)) < 5


def test_distinct_seeds_draw_independent_noise() -> None:
    """Requests with different seeds must sample independently. `n > 1` gives child j the
    seed `seed + j`, so adjacent seeds matter most: on flat logits over 8 tokens, the token
    of seed s+1 must not be predictable from the token of seed s."""
    n, vocab = 20_000, 8
    metadata = make_metadata(n, temperature=1.0, seeds=torch.arange(n, dtype=torch.int64) + 1000)
    out = make_sampler().sample(logits=torch.zeros(n, vocab), metadata=metadata)
    tokens = out.sampled_token_ids[:, 0]
    # Marginal is uniform either way.
    freqs = torch.bincount(tokens, minlength=vocab).float() / n
    assert float((freqs - 1 / vocab).abs().max()) <= MAX_ABS_ERR
    # Independent pairs: P(t[s+1] == t[s] - 1) = 7/64 and P(t[s+1] == t[s]) = 1/8.
    shifted = float((tokens[1:] == tokens[:-1] - 1).float().mean())
    same = float((tokens[1:] == tokens[:-1]).float().mean())
    assert abs(shifted - 7 / 64) <= 0.02, (
        f"P(token[seed+1] == token[seed] - 1) = {shifted:.3f}, independent draws give "
        f"{7 / 64:.3f}: adjacent seeds reuse each other's noise shifted by one token"
    )
    assert abs(same - 1 / 8) <= 0.02


def test_greedy_rows_ignore_noise_and_filters() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))
    metadata = make_metadata(
        64,
        temperature=[0.0] * 32 + [1e-6] * 32,
        top_k=2,
        seeds=torch.arange(64, dtype=torch.int64),
    )
    out = make_sampler().sample(logits=logits.clone(), metadata=metadata).sampled_token_ids
    assert out[:, 0].tolist() == logits.argmax(dim=1).tolist()


def _hf_generate(model: Any, prompt: list[int], **kwargs: Any) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.int64),
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    # The gap of the processed scores (after min_new_tokens / repetition penalty).
    gaps = [float(sc[0].topk(2).values.diff().neg()) for sc in out.scores]
    assert min(gaps) >= 1e-3, f"reference top-2 gap {min(gaps):.3g} too small"
    return out.sequences[0, len(prompt) :].tolist()


# (3) Penalties --------------------------------------------------------------------------
def penalty_metadata(
    histories: list[list[int]], presence: list[float], frequency: list[float], rep: list[float]
) -> SamplingMetadata:
    return make_metadata(
        len(histories),
        output_token_ids=histories,
        penalties=(torch.tensor(presence), torch.tensor(frequency), torch.tensor(rep)),
    )


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    metadata = penalty_metadata([[0, 1, 1]], [0.0], [0.0], [2.0])
    apply_penalties(logits, metadata)
    # Seen tokens 0 (positive) and 1 (negative, seen twice: applied once); others unchanged.
    assert logits.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.5]]


def test_frequency_penalty_scales_with_count_presence_does_not() -> None:
    logits = torch.zeros(2, 5)
    history = [3, 3, 3, 1]
    metadata = penalty_metadata([history, history], [0.0, 0.5], [0.25, 0.0], [1.0, 1.0])
    apply_penalties(logits, metadata)
    assert logits[0].tolist() == [0.0, -0.25, 0.0, -0.75, 0.0]
    assert logits[1].tolist() == [0.0, -0.5, 0.0, -0.5, 0.0]


def test_penalties_combined_rowwise_and_negative_values() -> None:
    logits = torch.tensor([[3.0, -1.0, 0.0, 2.0], [3.0, -1.0, 0.0, 2.0], [3.0, -1.0, 0.0, 2.0]])
    metadata = penalty_metadata(
        [[0, 0, 1], [], [3, -1]],  # -1: a placeholder whose id is not known yet: skipped
        [0.5, 1.0, -0.5],
        [0.25, 1.0, -1.0],
        [1.5, 3.0, 2.0],
    )
    apply_penalties(logits, metadata)
    # row 0: token 0 seen twice: 3/1.5 - 2*0.25 - 0.5 = 1.0; token 1: -1*1.5 - 0.25 - 0.5
    # row 1: nothing seen: unchanged.  row 2: token 3 once: 2/2 + 1 + 0.5 (negative values)
    expected = [[1.0, -2.25, 0.0, 2.0], [3.0, -1.0, 0.0, 2.0], [3.0, -1.0, 0.0, 2.5]]
    assert torch.allclose(logits, torch.tensor(expected)), logits.tolist()


def test_sampler_applies_penalties_before_greedy_argmax() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    metadata = make_metadata(1, temperature=0.0)
    metadata.output_token_ids = [[0, 0]]
    metadata.penalties = (torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([1.0]))
    out = make_sampler().sample(logits=logits, metadata=metadata).sampled_token_ids
    assert out.tolist() == [[1]]  # 5 - 2*1 = 3 < 4


def test_repetition_penalty_matches_transformers_including_prompt(
    tiny_models, hf_reference
) -> None:
    """vLLM (and transformers) apply the repetition penalty to tokens of the prompt and of
    the output so far. Greedy with a strong penalty must match transformers' generate."""
    model_dir = tiny_models["qwen2"]
    prompts = [_ids(300 + i, 24) for i in range(4)]
    params = SamplingParams(temperature=0.0, repetition_penalty=5.0, max_tokens=16, ignore_eos=True)
    outs = tiny_llm(model_dir).generate(prompts, params)
    model = hf_reference.model(model_dir)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _hf_generate(
            model, prompt, max_new_tokens=16, repetition_penalty=5.0, eos_token_id=None
        )
        assert list(out.outputs[0].token_ids) == ref, (
            f"repetition_penalty=5: tandem {list(out.outputs[0].token_ids)} != transformers "
            f"{ref}; tandem tokens that occur in the prompt: "
            f"{sorted(set(out.outputs[0].token_ids) & set(prompt))}"
        )


def _reference_penalised_greedy(
    model: Any, prompt: list[int], n: int, presence: float, frequency: float
) -> list[int]:
    """Greedy decoding with vLLM's presence/frequency penalties (over the output so far),
    recomputing the whole sequence with transformers at every step."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        top = logits.topk(2).values
        assert float(top[0] - top[1]) >= 1e-3, "reference top-2 gap too small"
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_presence_frequency_penalties_end_to_end(
    tiny_models, hf_reference, async_scheduling: bool
) -> None:
    model_dir = tiny_models["llama"]
    model = hf_reference.model(model_dir)
    llm = tiny_llm(model_dir, async_scheduling=async_scheduling)
    prompts = [_ids(700 + i, 6 + 5 * i) for i in range(3)]
    settings = [(2.0, 0.0), (0.0, 2.0), (1.0, 1.5)]
    params = [
        SamplingParams(
            temperature=0.0,
            presence_penalty=p,
            frequency_penalty=f,
            max_tokens=16,
            ignore_eos=True,
        )
        for p, f in settings
    ]
    outs = llm.generate(prompts, params)
    for prompt, (p, f), out in zip(prompts, settings, outs, strict=True):
        expected = _reference_penalised_greedy(model, prompt, 16, p, f)
        assert list(out.outputs[0].token_ids) == expected, (p, f)


# (4) min_tokens blocks EOS and stop tokens ---------------------------------------------
def test_min_tokens_blocks_eos_greedy_matches_transformers(
    tiny_models, hf_greedy, hf_reference
) -> None:
    model_dir = tiny_models["llama"]
    prompt = _ids(77, 9)
    greedy = hf_greedy(model_dir, prompt, 12)
    eos = greedy[0]  # make the first greedy token the EOS
    llm = tiny_llm(model_dir, eos_token_id=eos)
    assert llm.config.model.eos_token_id == eos
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    assert plain.token_ids == [eos] and plain.finish_reason == "stop"
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=4)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert eos not in out.token_ids[:4]
    expected = _hf_generate(
        hf_reference.model(model_dir),
        prompt,
        max_new_tokens=12,
        min_new_tokens=4,
        eos_token_id=eos,
    )
    assert list(out.token_ids) == expected
    if eos in out.token_ids:
        assert out.token_ids.index(eos) == len(out.token_ids) - 1 >= 4
        assert out.finish_reason == "stop"
    else:
        assert out.finish_reason == "length"


def test_min_tokens_blocks_stop_tokens_and_eos_when_sampling(tiny_models) -> None:
    """Every token but 0 and 1 stops the request (2 is EOS, 3.. are stop tokens): before
    min_tokens only 0 and 1 can come out; at min_tokens the request may stop."""
    llm = tiny_llm(tiny_models["qwen3"], async_scheduling=True)
    assert llm.config.model.eos_token_id == TINY_EOS
    stop_ids = list(range(3, TINY_VOCAB))
    min_tokens = 6
    prompts = [_ids(500 + i, 5 + i) for i in range(8)]
    params = [
        SamplingParams(
            temperature=2.0,
            seed=i if i % 2 else None,
            min_tokens=min_tokens,
            max_tokens=20,
            stop_token_ids=stop_ids,
        )
        for i in range(8)
    ]
    outs = llm.generate(prompts, params)
    stopped_on = set()
    for out in outs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        assert len(tokens) > min_tokens
        assert all(t in (0, 1) for t in tokens[:min_tokens]), tokens
        assert all(t in (0, 1) for t in tokens[:-1]), tokens  # it stops at the first stop
        assert completion.finish_reason == "stop"
        last = tokens[-1]
        assert last not in (0, 1)
        if last == TINY_EOS:
            assert completion.stop_reason is None
        else:
            assert completion.stop_reason == last
        stopped_on.add(last)
    assert len(stopped_on) > 1  # sampling did something


# (5) Bad words ----------------------------------------------------------------------------
def _state(
    history: list[int], params: SamplingParams, prompt: list[int] | None = None
) -> tuple[RequestState, list[int]]:
    prompt = prompt if prompt is not None else [9, 9, 9]
    state = RequestState("r", len(prompt), params, eos_token_id=TINY_EOS)
    return state, list(prompt) + list(history)


def _blocked(state: tuple[RequestState, list[int]], num_drafts: int) -> list[int]:
    """Blocked tokens of the row after the request's tokens and `num_drafts` drafts (0)."""
    return blocked_tokens(state[0], state[1], [0] * num_drafts)


def test_bad_words_block_last_token_when_prefix_matches() -> None:
    params = SamplingParams(bad_words_token_ids=[[7], [4, 5], [1, 2, 3]])
    blocked = _blocked
    assert sorted(blocked(_state([], params), 0)) == [7]
    assert sorted(blocked(_state([8, 4], params), 0)) == [5, 7]
    assert sorted(blocked(_state([4, 8], params), 0)) == [7]
    assert sorted(blocked(_state([1, 2], params), 0)) == [3, 7]
    assert sorted(blocked(_state([2], params), 0)) == [7]
    # The prompt does not count as history for a bad word's prefix (vLLM: output only).
    assert sorted(blocked(_state([], params, prompt=[1, 2]), 0)) == [7]


def test_min_tokens_blocked_tokens_unit() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=[11, 12])
    blocked = _blocked
    assert sorted(blocked(_state([], params), 0)) == [TINY_EOS, 11, 12]
    assert sorted(blocked(_state([5], params), 0)) == [TINY_EOS, 11, 12]
    assert blocked(_state([5, 6], params), 0) == []
    ignore = SamplingParams(min_tokens=2, stop_token_ids=[11], ignore_eos=True)
    assert blocked(_state([], ignore), 0) == [11]


def test_sampler_never_draws_blocked_tokens() -> None:
    rows = 2000
    blocked_rows = torch.arange(rows).repeat_interleave(2)
    blocked_ids = torch.tensor([0, 3]).repeat(rows)
    metadata = make_metadata(
        rows,
        temperature=1.0,
        seeds=torch.arange(rows, dtype=torch.int64) * 101,
        blocked_tokens=(blocked_rows, blocked_ids),
    )
    logits = torch.tensor([[9.0, 0.0, 0.0, 9.0, 0.0, 0.0]]).expand(rows, -1).clone()
    tokens = make_sampler().sample(logits=logits, metadata=metadata).sampled_token_ids[:, 0]
    assert not bool(((tokens == 0) | (tokens == 3)).any())
    assert set(tokens.tolist()) == {1, 2, 4, 5}


def test_bad_words_token_ids_end_to_end(tiny_models, hf_greedy) -> None:
    model_dir = tiny_models["qwen2"]
    prompt = _ids(901, 14)
    greedy = hf_greedy(model_dir, prompt, 16)
    llm = tiny_llm(model_dir, async_scheduling=True)
    # A one-token bad word: the greedy first token never appears anywhere.
    x = greedy[0]
    outs = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(
                temperature=0.0, max_tokens=16, ignore_eos=True, bad_words_token_ids=[[x]]
            ),
            SamplingParams(
                temperature=1.5, seed=3, max_tokens=16, ignore_eos=True, bad_words_token_ids=[[x]]
            ),
        ],
    )
    for out in outs:
        assert x not in out.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 16
    # A two-token word [a, b]: a is allowed, b is blocked right after a only.
    a, b = greedy[0], greedy[1]
    out = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True, bad_words_token_ids=[[a, b]]
        ),
    )[0]
    tokens = list(out.outputs[0].token_ids)
    assert tokens[0] == a and tokens[1] != b
    assert all(not (p == a and q == b) for p, q in zip(tokens, tokens[1:], strict=False))


def test_bad_words_strings_are_blocked_on_a_real_tokenizer(smollm2_llm) -> None:
    """`SamplingParams.bad_words` (strings) must be tokenised by the front door into
    `bad_words_token_ids` and blocked: greedy 'The capital of France is Paris.' must not
    produce the ' Paris' token with bad_words=['Paris']."""
    llm = smollm2_llm
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    base = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    assert "Paris" in base.text
    paris = llm.tokenizer.encode(" Paris", add_special_tokens=False)
    assert paris[-1] in base.token_ids
    out = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=12, bad_words=["Paris"]))
    tokens = list(out[0].outputs[0].token_ids)
    assert paris[-1] not in tokens, (
        f"bad_words=['Paris'] ignored: output {out[0].outputs[0].text!r} still has token "
        f"{paris[-1]} (' Paris')"
    )


def test_greedy_tokens_are_argmaxs_first_maximum_with_ties_inf_and_nan() -> None:
    """`greedy_tokens` (max's indices, the faster op) picks what `argmax(dim=1)` picks."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 3, (16, 4099), generator=gen).float()  # many ties per row
    logits[:, ::5] = float("-inf")
    logits[1] = float("-inf")
    logits[2, 7] = logits[2, 4000] = float("inf")
    logits[3, 100] = float("nan")
    logits[4, 9] = logits[4, 10] = float("nan")
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=1))
    assert greedy_tokens(logits)[3].item() == 100 and greedy_tokens(logits)[2].item() == 7
