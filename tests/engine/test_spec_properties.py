"""Property tests: speculation never changes outputs, and the ledger stays sound with drafts.

Random workloads (1-10 requests, prompts over a small alphabet, random max_tokens,
stop tokens, min_tokens, arrivals between steps) run on the scripted model with the
`scripted-drafter` (k drafts per step, a random number of them right, per request) under
random limits (token budget 1-48, 1-6 sequences, block size 1-8, KV pools from one
max-length sequence up, so drafts get trimmed to the budget and to `max_model_len` and
requests are preempted with drafts in flight), sync and async scheduling. Every engine
checks the ledger and KV invariants after every step (`check_invariants`).

Properties:
1. greedy: every request gets exactly the scripted reference's tokens and finish reason,
   whatever the drafts; every KV block is free once idle;
2. seeded sampling (temperature 0.8) gives the same tokens with and without drafts, sync
   and async: the default sampler verifies a deterministic drafter's drafts by comparing
   them with the target token drawn from (seed, output position), which is exact rejection
   sampling for a one-hot draft distribution and makes outputs independent of the drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from budget import examples
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tandem.testing.engine import expected_scripted_output, make_request, make_scripted_engine
from tandem.testing.scripted_model import scripted_next_token

VOCAB = 128
EOS = 1
ALPHABET = [2, 3, 5, 7]
MAX_STEPS = 20_000

PROPERTY_SETTINGS = settings(
    max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@dataclass(frozen=True)
class Spec:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]
    min_tokens: int
    arrival: int
    num_correct: int
    seed: int


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_spec_tokens: int


@st.composite
def limits_strategy(draw: st.DrawFn) -> Limits:
    max_model_len = draw(st.integers(48, 96))
    block_size = draw(st.integers(1, 8))
    min_blocks = math.ceil(max_model_len / block_size)
    num_kv_blocks = draw(st.one_of(st.just(min_blocks), st.integers(min_blocks, 3 * min_blocks)))
    return Limits(
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=draw(st.integers(1, 48)),
        max_num_seqs=draw(st.integers(1, 6)),
        num_spec_tokens=draw(st.integers(1, 4)),
    )


def greedy_tokens(prompt: list[int], n: int) -> list[int]:
    history = list(prompt)
    for _ in range(n):
        history.append(scripted_next_token(history, VOCAB))
    return history[len(prompt) :]


@st.composite
def workload_strategy(draw: st.DrawFn, max_requests: int = 10) -> list[Spec]:
    specs = []
    for i in range(draw(st.integers(1, max_requests))):
        prompt = draw(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=36))
        max_tokens = draw(st.integers(1, 40))
        stop_kind = draw(st.sampled_from(["none", "none", "own"]))
        stop: tuple[int, ...] = ()
        if stop_kind == "own":  # a token inside the output: it stops mid-run, maybe mid-draft
            own = greedy_tokens(prompt, max_tokens)
            stop = (own[draw(st.integers(0, len(own) - 1))],)
        specs.append(
            Spec(
                rid=f"r{i}",
                prompt=tuple(prompt),
                max_tokens=max_tokens,
                ignore_eos=draw(st.booleans()),
                stop_token_ids=stop,
                min_tokens=min(draw(st.sampled_from([0, 0, 2])), max_tokens),
                arrival=draw(st.one_of(st.just(0), st.integers(0, 10))),
                num_correct=draw(st.integers(0, 4)),
                seed=draw(st.integers(0, 2**31 - 1)),
            )
        )
    return specs


def run(
    limits: Limits,
    specs: list[Spec],
    async_scheduling: bool,
    drafts: bool = True,
    temperature: float = 0.0,
) -> dict[str, tuple[list[int], str | None]]:
    """Step until idle; per request, its tokens and finish reason. Fails on output after a
    finish, on a KV leak and on requests left behind."""
    overrides: dict[str, Any] = {
        "vocab_size": VOCAB,
        "eos_token_id": EOS,
        "max_model_len": limits.max_model_len,
        "block_size": limits.block_size,
        "num_kv_blocks": limits.num_kv_blocks,
        "max_num_batched_tokens": limits.max_num_batched_tokens,
        "max_num_seqs": limits.max_num_seqs,
        "async_scheduling": async_scheduling,
    }
    if drafts:
        overrides["speculative"] = {
            "method": "scripted",
            "num_speculative_tokens": limits.num_spec_tokens,
        }
        options = {"num_correct_by_request": {s.rid: s.num_correct for s in specs}}
        overrides["plugins"] = [
            {"name": "reference-scheduler"},
            {"name": "default-sampler"},
            {"name": "scripted-drafter", "options": options},
        ]
    engine = make_scripted_engine(**overrides)
    tokens: dict[str, list[int]] = {s.rid: [] for s in specs}
    reasons: dict[str, str | None] = {s.rid: None for s in specs}
    last_arrival = max(s.arrival for s in specs)
    step = 0
    while step <= last_arrival or engine.has_work():
        for s in specs:
            if s.arrival == step:
                params: dict[str, Any] = {
                    "max_tokens": s.max_tokens,
                    "ignore_eos": s.ignore_eos,
                    "stop_token_ids": list(s.stop_token_ids),
                    "min_tokens": s.min_tokens,
                    "temperature": temperature,
                }
                if temperature > 0:
                    params["seed"] = s.seed
                engine.add_request(make_request(s.rid, list(s.prompt), eos_token_id=EOS, **params))
        outputs, _ = engine.step_fn()
        for out in outputs:
            assert reasons[out.request_id] is None, f"output after finish: {out}"
            tokens[out.request_id].extend(out.new_token_ids)
            reasons[out.request_id] = out.finish_reason
        step += 1
        assert step < MAX_STEPS, "engine did not become idle"
    kv = engine.scheduler_state.kv_cache_manager
    assert kv.all_blocks_free(), f"KV leak: {kv.num_free_blocks} of {kv.num_blocks} free"
    assert not engine.scheduler_state.requests, "requests left in the scheduler"
    if drafts:
        scheduler = engine.plugin_manager.plugins_with_role("scheduler")[0]
        metrics = scheduler.spec_metrics
        event(f"drafts verified: {'yes' if metrics.num_draft_tokens else 'no'}")
        event(f"preemptions: {'yes' if scheduler.num_preemptions else 'no'}")
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


def expected(spec: Spec, limits: Limits) -> tuple[list[int], str]:
    params = make_request(
        spec.rid,
        list(spec.prompt),
        max_tokens=spec.max_tokens,
        ignore_eos=spec.ignore_eos,
        stop_token_ids=list(spec.stop_token_ids),
        min_tokens=spec.min_tokens,
    ).sampling_params
    return expected_scripted_output(list(spec.prompt), params, VOCAB, EOS, limits.max_model_len)


@PROPERTY_SETTINGS
@given(limits=limits_strategy(), specs=workload_strategy(), use_async=st.booleans())
def test_drafts_never_change_greedy_outputs(
    limits: Limits, specs: list[Spec], use_async: bool
) -> None:
    """Property 1: exact greedy outputs with drafts, invariants every step, no KV leak."""
    outputs = run(limits, specs, use_async)
    for spec in specs:
        assert outputs[spec.rid] == expected(spec, limits), spec


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limits=limits_strategy(), specs=workload_strategy(max_requests=6))
def test_seeded_sampling_with_drafts_equals_without(limits: Limits, specs: list[Spec]) -> None:
    """Property 2: seeded outputs are the same with and without drafts, sync and async."""
    reference = run(limits, specs, async_scheduling=False, drafts=False, temperature=0.8)
    for use_async in (False, True):
        outputs = run(limits, specs, async_scheduling=use_async, temperature=0.8)
        assert outputs == reference, f"async={use_async}"
