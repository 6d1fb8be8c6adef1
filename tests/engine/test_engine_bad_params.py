"""Sampling parameters that no step could run are refused at `add_request`, naming the
field; the requests beside them finish exactly and the engine goes on serving (the
held-out fuzz's single-request failures, ../shared/reference/fuzz-failures.md D)."""

from __future__ import annotations

from typing import Any

import pytest

from tandem import LLM
from tandem.schema.sampling_params import SamplingParams
from tandem.testing import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    make_scripted_engine,
)

VOCAB = 128
GOOD = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6, 7], [9] * 13, list(range(10, 30))]

#: (field named in the error, bad sampling parameters)
BAD_PARAMS: list[tuple[str, dict[str, Any]]] = [
    ("bad_words_token_ids", {"bad_words_token_ids": [[10**9]]}),
    ("bad_words_token_ids", {"bad_words_token_ids": [[]]}),
    ("stop_token_ids", {"stop_token_ids": [10**9], "min_tokens": 2}),
    ("logprobs", {"logprobs": VOCAB + 1}),
    ("logprobs", {"logprobs": 21}),  # over max_logprobs (vLLM's default 20)
    ("seed", {"seed": 2**64}),
    ("seed", {"seed": -1}),
]


def _expected(prompt: list[int]) -> tuple[list[int], str]:
    return expected_scripted_output(prompt, GOOD, VOCAB, 1, 64)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(
    ("field", "bad"), BAD_PARAMS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_PARAMS)]
)
def test_bad_request_is_refused_while_others_run(
    field: str, bad: dict[str, Any], async_scheduling: bool
) -> None:
    engine = make_scripted_engine(
        async_scheduling=async_scheduling,
        max_num_batched_tokens=16,
        num_kv_blocks=40,
        max_model_len=64,
    )
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(make_request(str(i), prompt, max_tokens=8, ignore_eos=True))
    outputs = engine.run_step()[0] + engine.run_step()[0]  # the good requests are running
    with pytest.raises(ValueError, match=field):
        engine.add_request(make_request("bad", [5, 6, 7], **{"temperature": 0.5, **bad}))
    outputs += engine.run_until_idle()
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        reasons[out.request_id] = out.finish_reason
    assert "bad" not in tokens
    for i, prompt in enumerate(PROMPTS):
        assert (tokens[str(i)], reasons[str(i)]) == _expected(prompt)
    # The refused id is free for a good request; the engine still serves.
    engine.add_request(make_request("bad", PROMPTS[0], max_tokens=8, ignore_eos=True))
    assert collect_outputs(engine) == {"bad": _expected(PROMPTS[0])}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_llm_generate_refuses_bad_params_then_serves(async_scheduling: bool) -> None:
    llm = LLM(
        model="scripted",
        async_scheduling=async_scheduling,
        max_model_len=64,
        num_kv_blocks=40,
        block_size=4,
    )
    for field, bad in BAD_PARAMS:
        with pytest.raises(ValueError, match=field):
            params = SamplingParams(**{"temperature": 0.5, **bad})
            llm.generate(PROMPTS, [GOOD, params, GOOD], use_tqdm=False)
        outs = llm.generate(PROMPTS, GOOD, use_tqdm=False)
        got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        assert got == [_expected(p) for p in PROMPTS], field


@pytest.mark.parametrize("seed", [2**63 - 1, 2**63, 2**64 - 1])
def test_seeds_at_the_edges_of_the_accepted_range_run_beside_others(seed: int) -> None:
    llm = LLM(model="scripted", max_model_len=64, num_kv_blocks=40, block_size=4)
    seeded = SamplingParams(temperature=0.8, seed=seed, n=2, max_tokens=8, ignore_eos=True)
    first = llm.generate(PROMPTS, [GOOD, seeded, GOOD], use_tqdm=False)
    again = llm.generate(PROMPTS[1:2], seeded, use_tqdm=False)
    assert [o.token_ids for o in first[1].outputs] == [o.token_ids for o in again[0].outputs]
    assert all(len(o.token_ids) == 8 for o in first[1].outputs)
    assert (first[0].outputs[0].token_ids, first[0].outputs[0].finish_reason) == _expected(
        PROMPTS[0]
    )
