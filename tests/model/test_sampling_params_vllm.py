"""SamplingParams as a vLLM user meets it: validation messages, checks against the model,
the seed range, tiny temperatures, `logit_bias` and `allowed_token_ids`.

Fast: the scripted model (a known distribution under temperature) and hand-built
`SamplingMetadata` for the sampler.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tandem.core.worker.input_batch import InputBatch, seed_as_int64
from tandem.core.worker.sampling_metadata import SamplingMetadata
from tandem.llm import LLM
from tandem.plugins.default_sampler import DefaultSampler
from tandem.schema.sampling_params import (
    DEFAULT_MAX_LOGPROBS,
    MAX_N,
    SAMPLING_EPS,
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
    validate_for_model,
)
from tandem.stack_file import load_config
from tandem.testing.engine import (
    collect_outputs,
    make_request,
    make_scripted_engine,
    make_scripted_llm,
)

VOCAB = 64
EOS = 1


def scripted_llm(**overrides: Any) -> LLM:
    return make_scripted_llm(**{"vocab_size": VOCAB, "eos_token_id": EOS, **overrides})


def generate(llm: LLM, prompts: list[list[int]], params: Any) -> list[Any]:
    return llm.generate(prompts, params, use_tqdm=False)


def prompt(i: int, n: int = 12) -> list[int]:
    return [(7 * i + 3 * j) % (VOCAB - 2) + 2 for j in range(n)]


# (1) Validation messages: one line per problem, field and expected value ----------------
@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"temperature": -1}, "SamplingParams: temperature: expected a number >= 0 (got -1)"),
        ({"temperature": float("inf")}, "temperature: expected a finite number (got inf)"),
        ({"temperature": float("nan")}, "temperature: expected a finite number"),
        ({"top_p": 0}, "top_p: expected a number > 0 (got 0)"),
        ({"max_tokens": 0}, "max_tokens: expected an integer >= 1 (got 0)"),
        ({"max_tokens": "many"}, "max_tokens: expected an integer (got 'many')"),
        ({"n": 10**9}, f"n: expected an integer <= {MAX_N} (got 1000000000)"),
        ({"seed": 2**64}, "seed: expected an integer in [0, 2**64 - 1] (got 18446744073709551616)"),
        ({"seed": -1}, "seed: expected an integer in [0, 2**64 - 1] (got -1)"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens: expected at most max_tokens (2) (got 5)"),
        ({"stop_token_ids": [3.0]}, "stop_token_ids.0: expected an integer token id (got 3.0)"),
        ({"stop_token_ids": [1, 3.7]}, "stop_token_ids.1: expected an integer token id (got 3.7)"),
        ({"stop_token_ids": [-4]}, "stop_token_ids.0: expected an integer >= 0 (got -4)"),
        (
            {"bad_words_token_ids": [[2, 3.0]]},
            "bad_words_token_ids.0.1: expected an integer token id (got 3.0)",
        ),
        (
            {"bad_words_token_ids": [[2], []]},
            "bad_words_token_ids: expected non-empty token id lists (got [] at index 1)",
        ),
        ({"allowed_token_ids": [1.5]}, "allowed_token_ids.0: expected an integer token id"),
        ({"allowed_token_ids": []}, "allowed_token_ids: expected a non-empty list of token ids"),
        ({"logit_bias": {5: 150.0}}, "logit_bias.5: expected a number <= 100 (got 150.0)"),
        ({"logit_bias": {2.5: 1.0}}, "logit_bias: expected an integer token id (got 2.5)"),
        ({"logprobs": -2}, "logprobs: expected an integer >= -1 (got -2)"),
        ({"prompt_logprobs": -2}, "prompt_logprobs: expected an integer >= -1 (got -2)"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens: expected an integer >= 1, or -1"),
        ({"output_kind": "partial"}, "output_kind: expected one of CUMULATIVE, DELTA, FINAL_ONLY"),
        ({"stop": ["x"], "detokenize": False}, "stop: stop strings need detokenize=True"),
        ({"foo": 1}, "SamplingParams: foo: unknown field 'foo'"),
        ({"temprature": 0.5}, "unknown field 'temprature' (did you mean 'temperature'?)"),
        ({"max_token": 5}, "unknown field 'max_token' (did you mean 'max_tokens'?)"),
    ],
)
def test_constructor_error_is_one_line_naming_field_and_expected_value(
    kwargs: dict[str, Any], expected: str
) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert expected in message
    assert "\n" not in message
    assert "pydantic" not in message and "http" not in message
    assert "Value error" not in message and "Input should" not in message


def test_several_problems_give_one_line_each() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(temperature=-1, top_p=3, bogus=True)
    lines = str(info.value).splitlines()
    assert len(lines) == 3
    assert [line.split(":")[1].strip() for line in lines] == ["temperature", "top_p", "bogus"]


def test_assignment_is_validated_with_the_same_message() -> None:
    params = SamplingParams()
    with pytest.raises(SamplingParamsError, match="temperature: expected a finite number"):
        params.temperature = float("inf")
    assert params.temperature == 1.0


def test_token_ids_accept_integers_of_any_integer_type() -> None:
    params = SamplingParams(
        stop_token_ids=[np.int64(3), 4],
        allowed_token_ids=[np.int32(5)],
        logit_bias={"7": -1.5, 8: 2},
    )
    assert params.stop_token_ids == [3, 4] and all(type(t) is int for t in params.stop_token_ids)
    assert params.allowed_token_ids == [5]
    assert params.logit_bias == {7: -1.5, 8: 2.0}


def test_n_cap_is_documented_and_enforced_before_anything_runs() -> None:
    assert str(MAX_N) in SamplingParams.model_fields["n"].description
    assert SamplingParams(n=MAX_N).n == MAX_N
    with pytest.raises(SamplingParamsError, match="n: expected an integer <= "):
        SamplingParams(n=MAX_N + 1)


def test_new_fields_have_vllm_defaults() -> None:
    params = SamplingParams()
    assert params.logit_bias is None and params.allowed_token_ids is None
    assert params.prompt_logprobs is None and params.truncate_prompt_tokens is None
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert params.detokenize and params.spaces_between_special_tokens
    assert SamplingParams(output_kind="delta").output_kind == RequestOutputKind.DELTA
    assert SamplingParams(output_kind=2).output_kind == RequestOutputKind.FINAL_ONLY


# (2) Checks against the model -------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stop_token_ids": [3, VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": [10**6], "min_tokens": 2}, "stop_token_ids"),
        ({"bad_words_token_ids": [[2], [3, VOCAB + 9]]}, "bad_words_token_ids.1"),
        ({"allowed_token_ids": [0, VOCAB]}, "allowed_token_ids"),
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(kwargs: dict[str, Any], field: str) -> None:
    params = SamplingParams(**kwargs)
    with pytest.raises(SamplingParamsError) as info:
        validate_for_model(params, VOCAB, DEFAULT_MAX_LOGPROBS)
    message = str(info.value)
    assert f"SamplingParams: {field}: expected token ids in [0, {VOCAB})" in message
    assert "\n" not in message


def test_logprobs_are_capped_by_max_logprobs_and_the_vocabulary() -> None:
    for field in ("logprobs", "prompt_logprobs"):
        validate_for_model(SamplingParams(**{field: 20}), VOCAB, 20)
        with pytest.raises(SamplingParamsError, match=f"{field}: expected at most 20 .* 21"):
            validate_for_model(SamplingParams(**{field: 21}), VOCAB, 20)
        # -1 means the whole vocabulary (vLLM): refused under a cap, allowed without one.
        with pytest.raises(SamplingParamsError, match=f"{field}: expected at most 20"):
            validate_for_model(SamplingParams(**{field: -1}), VOCAB, 20)
        validate_for_model(SamplingParams(**{field: -1}), VOCAB, -1)
        with pytest.raises(SamplingParamsError, match=f"{field}: .*vocabulary size {VOCAB}"):
            validate_for_model(SamplingParams(**{field: VOCAB + 1}), VOCAB, -1)
    validate_for_model(SamplingParams(stop_token_ids=[VOCAB - 1]), VOCAB, 20)


def test_the_engine_refuses_bad_params_and_keeps_serving() -> None:
    llm = scripted_llm()
    with pytest.raises(ValueError, match="stop_token_ids: expected token ids in"):
        generate(llm, [prompt(0)], SamplingParams(stop_token_ids=[VOCAB + 3], min_tokens=2))
    out = generate(llm, [prompt(0)], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_full_vocabulary_logprobs_when_the_cap_allows() -> None:
    llm = scripted_llm(max_logprobs=VOCAB)  # -1 counts as the vocabulary size
    out = generate(llm, [prompt(1)], SamplingParams(max_tokens=3, logprobs=-1, prompt_logprobs=-1))
    assert all(len(entry) == VOCAB for entry in out[0].outputs[0].logprobs)
    assert all(len(entry) == VOCAB for entry in out[0].prompt_logprobs[1:])


# (3) Seeds: [0, 2**64 - 1], reproducible at the edges ---------------------------------------
EDGE_SEEDS = [2**63 - 1, 2**63, 2**64 - 1]
#: Temperature 5 flattens the scripted logits: every token is likely enough that
#: different noise gives different tokens.
SEEDED = {"temperature": 5.0, "max_tokens": 24, "ignore_eos": True}
SEED_PROMPT = prompt(3, 10)


def test_seed_range_is_stated() -> None:
    description = SamplingParams.model_fields["seed"].description
    assert "[0, 2**64 - 1]" in description
    assert "[0, 2**64 - 1]" in (SamplingParams.__doc__ or "")
    for seed in (0, *EDGE_SEEDS):
        assert SamplingParams(seed=seed).seed == seed


def test_seeds_map_to_distinct_int64_bit_patterns() -> None:
    assert [seed_as_int64(s) for s in (0, 2**63 - 1, 2**63, 2**64 - 1)] == [
        0,
        2**63 - 1,
        -(2**63),
        -1,
    ]
    with pytest.raises(ValueError, match="seed"):
        seed_as_int64(2**64)
    batch = InputBatch(max_num_reqs=2)
    batch.add("seeded", SamplingParams(temperature=1.0, seed=2**64 - 1))
    batch.add("unseeded", SamplingParams(temperature=1.0))
    assert batch.seeded.tolist()[:2] == [True, False]
    assert int(batch.seeds[0]) == -1


def _seeded_alone(seed: int, **overrides: Any) -> list[int]:
    out = generate(scripted_llm(**overrides), [SEED_PROMPT], SamplingParams(seed=seed, **SEEDED))
    return list(out[0].outputs[0].token_ids)


def _batch_around(seed: int) -> tuple[list[list[int]], list[SamplingParams], int]:
    prompts = [prompt(10 + i, 5 + 3 * i) for i in range(6)]
    params = [
        SamplingParams(temperature=5.0, max_tokens=30, ignore_eos=True),  # unseeded
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=5.0, seed=seed ^ 1, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=2.0, top_p=0.8, seed=seed, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=5.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=5.0, seed=0, max_tokens=10, ignore_eos=True),
    ]
    prompts.insert(2, SEED_PROMPT)
    params.insert(2, SamplingParams(seed=seed, **SEEDED))
    return prompts, params, 2


@pytest.mark.parametrize("seed", EDGE_SEEDS, ids=["2**63-1", "2**63", "2**64-1"])
def test_edge_seed_reproducible_across_runs_and_batches(seed: int) -> None:
    alone = _seeded_alone(seed)
    assert len(alone) == 24
    assert _seeded_alone(seed) == alone  # a second engine
    assert _seeded_alone(seed, async_scheduling=True) == alone
    for overrides in (
        {"async_scheduling": False},
        {"async_scheduling": True},
        {"async_scheduling": True, "max_num_batched_tokens": 8},
    ):
        prompts, params, index = _batch_around(seed)
        outs = generate(scripted_llm(**overrides), prompts, params)
        assert list(outs[index].outputs[0].token_ids) == alone, overrides


def test_edge_seeds_are_distinct_streams() -> None:
    streams = {seed: tuple(_seeded_alone(seed)) for seed in (0, 1, *EDGE_SEEDS)}
    assert len(set(streams.values())) == len(streams)


@pytest.mark.parametrize(
    ("seed", "second_child_seed"), [(2**63 - 1, 2**63), (2**64 - 1, 0)], ids=["2**63-1", "2**64-1"]
)
def test_n2_children_get_seed_plus_j_modulo_2_64(seed: int, second_child_seed: int) -> None:
    llm = scripted_llm()
    out = generate(llm, [SEED_PROMPT], SamplingParams(n=2, seed=seed, **SEEDED))[0]
    assert [o.index for o in out.outputs] == [0, 1]
    assert list(out.outputs[0].token_ids) == _seeded_alone(seed)
    assert list(out.outputs[1].token_ids) == _seeded_alone(second_child_seed)


def test_child_params_wrap_the_seed() -> None:
    assert SamplingParams(seed=2**64 - 1, n=3).child(2).seed == 1
    assert SamplingParams(n=3).child(2).seed is None
    assert SamplingParams(seed=5, n=3).child(2).n == 1


# (4) Temperatures: below 1e-5 is greedy; any temperature keeps min_tokens ---------------------
def make_sampler() -> DefaultSampler:
    return DefaultSampler(load_config(None, model="scripted", seed=0), DefaultSampler.Options())


def metadata(rows: int, **fields: Any) -> SamplingMetadata:
    values: dict[str, Any] = {
        "all_greedy": False,
        "temperature": torch.ones(rows),
        "top_k": torch.full((rows,), -1, dtype=torch.int64),
        "top_p": torch.ones(rows),
        "min_p": torch.zeros(rows),
        "seeds": torch.arange(rows, dtype=torch.int64),
        "seeded": torch.ones(rows, dtype=torch.bool),
        "output_positions": torch.zeros(rows, dtype=torch.int64),
        "num_draft_tokens": [0] * rows,
        "draft_token_ids": torch.zeros(0, dtype=torch.int64),
    }
    values.update(fields)
    return SamplingMetadata(**values)


def test_tiny_temperature_with_top_p_is_greedy_in_the_sampler() -> None:
    rows = 256
    logits = torch.randn(rows, 50, generator=torch.Generator().manual_seed(1)) * 3
    for temperature in (1e-40, 1e-20, SAMPLING_EPS / 2):
        meta = metadata(
            rows, temperature=torch.full((rows,), temperature), top_p=torch.full((rows,), 0.5)
        )
        out = make_sampler().sample(logits=logits.clone(), metadata=meta).sampled_token_ids
        assert out[:, 0].tolist() == logits.argmax(dim=1).tolist(), temperature


def test_tiny_temperature_with_top_p_gives_the_greedy_tokens() -> None:
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-5).greedy
    llm = scripted_llm()
    prompts = [prompt(i) for i in range(4)]
    greedy = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=12))
    tiny = generate(
        llm, prompts, SamplingParams(temperature=1e-40, top_p=0.5, seed=7, max_tokens=12)
    )
    assert [o.outputs[0].token_ids for o in tiny] == [o.outputs[0].token_ids for o in greedy]


@pytest.mark.parametrize("temperature", [1e-40, 1e-5, 0.01, 1.0, 1e4, 1e30, 1e300])
def test_min_tokens_blocks_eos_and_stop_tokens_at_any_temperature(temperature: float) -> None:
    """Every token but 0 stops the request (1 is EOS, 2.. are stop tokens): before
    min_tokens only 0 can come out, then the request stops at once."""
    llm = scripted_llm()
    min_tokens = 5
    params = [
        SamplingParams(
            temperature=temperature,
            seed=s,
            min_tokens=min_tokens,
            max_tokens=12,
            stop_token_ids=list(range(2, VOCAB)),
            top_p=0.9 if s == 1 else 1.0,
        )
        for s in range(4)
    ]
    outs = generate(llm, [prompt(i) for i in range(4)], params)
    for out in outs:
        tokens = list(out.outputs[0].token_ids)
        assert tokens[:min_tokens] == [0] * min_tokens, (temperature, tokens)
        assert len(tokens) >= min_tokens + 1
        assert out.outputs[0].finish_reason == "stop"


# (5) logit_bias and allowed_token_ids ---------------------------------------------------------
def test_logit_bias_is_added_before_sampling_and_logprobs_stay_raw() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    top = logits.argmax(dim=1)
    rows = torch.tensor([0, 1, 1])
    tokens = torch.tensor([17, int(top[1]), 3])
    bias = torch.tensor([100.0, -100.0, -0.5])
    meta = metadata(
        3,
        all_greedy=True,
        temperature=torch.zeros(3),
        logit_bias=(rows, tokens, bias),
        max_num_logprobs=0,
    )
    out = make_sampler().sample(logits=logits.clone(), metadata=meta)
    sampled = out.sampled_token_ids[:, 0].tolist()
    second = logits[1].topk(2).indices[1]
    assert sampled == [17, int(second), int(top[2])]
    assert out.logprobs is not None
    raw = logits.log_softmax(dim=1)
    assert torch.allclose(out.logprobs[1][0, 0], raw[0, 17])


def test_allowed_token_ids_restrict_only_their_rows() -> None:
    rows = 3000
    allowed = [1, 4, 7]
    restricted = torch.arange(0, rows, 2)  # even rows are restricted
    meta = metadata(
        rows,
        allowed_token_ids=(
            restricted.repeat_interleave(len(allowed)),
            torch.tensor(allowed).repeat(len(restricted)),
        ),
    )
    out = make_sampler().sample(logits=torch.zeros(rows, 10), metadata=meta).sampled_token_ids
    even, odd = out[0::2, 0], out[1::2, 0]
    assert set(even.tolist()) == set(allowed)
    assert len(set(odd.tolist())) == 10


def test_logit_bias_and_allowed_token_ids_end_to_end() -> None:
    llm = scripted_llm(async_scheduling=True)
    outs = generate(
        llm,
        [prompt(0), prompt(1), prompt(2)],
        [
            SamplingParams(temperature=0.0, max_tokens=10, logit_bias={9: 100.0}),
            SamplingParams(temperature=3.0, seed=4, max_tokens=30, allowed_token_ids=[5, 6, 9]),
            SamplingParams(temperature=0.0, max_tokens=10),
        ],
    )
    assert list(outs[0].outputs[0].token_ids) == [9] * 10
    sampled = set(outs[1].outputs[0].token_ids)
    assert sampled == {5, 6, 9}
    assert len(set(outs[2].outputs[0].token_ids)) > 1  # the neighbours are untouched


def test_allowed_token_ids_hold_on_draft_rows() -> None:
    """With n-gram drafts each request samples 1 + drafts rows: every row of a restricted
    request is restricted, and its tokens (accepted drafts included) stay in the set."""
    engine = make_scripted_engine(
        vocab_size=8, eos_token_id=1, speculative={"method": "ngram", "num_speculative_tokens": 3}
    )
    repetitive = [2, 3, 4, 5] * 5
    engine.add_request(
        make_request(
            "r", repetitive, temperature=3.0, seed=1, max_tokens=40, allowed_token_ids=[2, 3, 4, 5]
        )
    )
    engine.add_request(make_request("free", repetitive, max_tokens=40))
    out = collect_outputs(engine)
    assert set(out["r"][0]) <= {2, 3, 4, 5} and len(out["r"][0]) == 40
    assert not set(out["free"][0]) <= {2, 3, 4, 5}
