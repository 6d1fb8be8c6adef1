"""Property tests of the whole engine on the scripted model.

Random workloads (1-12 requests, prompts of 1-40 tokens over a small alphabet so prefix
hits happen, random max_tokens / ignore_eos / stop_token_ids / min_tokens / priorities,
requests arriving between steps) run under random limits (token budget 1-64, 1-8 sequences,
block size 1-8, KV pools from one max-length sequence to three), with prefix caching and
async scheduling on or off and FCFS or priority scheduling. Engines from
`make_scripted_engine` check the ledger and KV invariants after every step and raise
`InvariantViolation`.

Properties:
1. greedy: every request gets exactly `expected_scripted_output`'s tokens and finish reason;
2. the invariants hold after every step, and every KV block is free once idle;
3. prefix caching and async scheduling do not change outputs, greedy or seeded;
4. aborts end a request with "abort" and a prefix of its expected tokens, never followed
   by more output; every other request is unaffected; no KV leaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from budget import examples
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tandem.core.engine_core import EngineCore
from tandem.testing.engine import (
    expected_scripted_output,
    make_request,
    make_scripted_engine,
)
from tandem.testing.scripted_model import scripted_next_token

VOCAB = 128
EOS = 1
ALPHABET = [2, 3, 5, 7]
MAX_STEPS = 50_000

PROPERTY_SETTINGS = settings(
    max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@dataclass(frozen=True)
class ReqSpec:
    rid: str
    prompt: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]
    min_tokens: int
    arrival: int  # added before this step (0 = before the first step)
    priority: int
    abort_at: int | None = None  # abort queued before this step
    seed: int | None = None

    def sampling(self, temperature: float = 0.0) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": list(self.stop_token_ids),
            "min_tokens": self.min_tokens,
            "temperature": temperature,
        }
        if temperature > 0:
            params["seed"] = self.seed
        return params


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool
    async_scheduling: bool
    scheduling_policy: str

    def overrides(self) -> dict[str, Any]:
        return {
            "vocab_size": VOCAB,
            "eos_token_id": EOS,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": self.enable_prefix_caching,
            "async_scheduling": self.async_scheduling,
            "scheduling_policy": self.scheduling_policy,
        }


# Strategies ---------------------------------------------------------------------------


@st.composite
def limits_strategy(draw: st.DrawFn) -> Limits:
    max_model_len = draw(st.integers(64, 128))
    block_size = draw(st.integers(1, 8))
    min_blocks = math.ceil(max_model_len / block_size)
    # Biased towards the smallest pools, where preemption happens.
    num_kv_blocks = draw(
        st.one_of(
            st.just(min_blocks),
            st.integers(min_blocks, min_blocks + min_blocks // 2),
            st.integers(min_blocks, 3 * min_blocks),
        )
    )
    return Limits(
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_num_seqs=draw(st.integers(1, 8)),
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
    )


def greedy_tokens(prompt: list[int], n: int) -> list[int]:
    """The scripted model's first `n` greedy tokens after `prompt`, ignoring every stop."""
    history = list(prompt)
    for _ in range(n):
        history.append(scripted_next_token(history, VOCAB))
    return history[len(prompt) :]


def tokens_strategy(length: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.sampled_from(ALPHABET), min_size=length, max_size=length)


@st.composite
def workload_strategy(
    draw: st.DrawFn, max_requests: int = 12, with_aborts: bool = False
) -> list[ReqSpec]:
    # A few shared stems: prompts start with a stem prefix, so blocks repeat across requests.
    num_stems = draw(st.integers(1, 3))
    stems = [draw(tokens_strategy(draw(st.integers(1, 40)))) for _ in range(num_stems)]
    # Half the time a crowd, so budgets, sequence limits and the KV pool all bind.
    n = draw(
        st.one_of(st.integers(1, max_requests), st.integers(max_requests * 2 // 3, max_requests))
    )
    specs = []
    for i in range(n):
        stem = draw(st.sampled_from(stems))
        length = draw(st.integers(1, 40))
        keep = draw(st.integers(0, min(length, len(stem))))
        prompt = stem[:keep] + draw(tokens_strategy(length - keep))
        max_tokens = draw(st.integers(1, 40))
        stop_kind = draw(st.sampled_from(["none", "none", "random", "own"]))
        if stop_kind == "random":
            stop_token_ids: tuple[int, ...] = tuple(
                draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2))
            )
        elif stop_kind == "own":  # a token the request will produce: it stops mid-stream
            own = greedy_tokens(prompt, max_tokens)
            stop_token_ids = (own[draw(st.integers(0, len(own) - 1))],)
        else:
            stop_token_ids = ()
        min_tokens = min(draw(st.sampled_from([0, 0, 0, 1, 3])), max_tokens)
        arrival = draw(st.one_of(st.just(0), st.integers(0, 12)))
        abort_at = None
        if with_aborts and draw(st.booleans()):
            abort_at = arrival + draw(st.integers(0, 20))
        specs.append(
            ReqSpec(
                rid=f"r{i}",
                prompt=tuple(prompt),
                max_tokens=max_tokens,
                ignore_eos=draw(st.booleans()),
                stop_token_ids=stop_token_ids,
                min_tokens=min_tokens,
                arrival=arrival,
                priority=draw(st.integers(0, 3)),
                abort_at=abort_at,
                seed=draw(st.integers(0, 2**31 - 1)),
            )
        )
    return specs


# Driving an engine ----------------------------------------------------------------------


def run_workload(
    limits: Limits, specs: list[ReqSpec], temperature: float = 0.0
) -> tuple[dict[str, tuple[list[int], str | None]], EngineCore]:
    """Add requests at their arrival step and queue aborts at their abort step, step until
    idle; per request, the concatenated tokens and the finish reason. Fails on any output
    after a request finished."""
    engine = make_scripted_engine(**limits.overrides())
    tokens: dict[str, list[int]] = {s.rid: [] for s in specs}
    reasons: dict[str, str | None] = {s.rid: None for s in specs}
    last_event = max(max(s.arrival, s.abort_at or 0) for s in specs)
    step = 0
    while True:
        for s in specs:
            if s.arrival == step:
                engine.add_request(
                    make_request(
                        s.rid,
                        list(s.prompt),
                        eos_token_id=EOS,
                        priority=s.priority,
                        arrival_time=float(s.arrival * 100 + int(s.rid[1:])),
                        **s.sampling(temperature),
                    )
                )
            if s.abort_at == step:
                engine.abort_requests([s.rid])
        if step > last_event and not engine.has_work():
            break
        outputs, _ = engine.step_fn()
        for out in outputs:
            assert reasons[out.request_id] is None, f"output after finish: {out}"
            tokens[out.request_id].extend(out.new_token_ids)
            reasons[out.request_id] = out.finish_reason
        step += 1
        assert step < MAX_STEPS, "engine did not become idle"
    assert not engine.batch_queue
    kv = engine.scheduler_state.kv_cache_manager
    assert kv.all_blocks_free(), (
        f"KV leak: {kv.num_free_blocks} of {kv.num_blocks} free, {kv.num_fenced_blocks} fenced"
    )
    assert not engine.scheduler_state.requests, "requests left in the scheduler"
    scheduler = engine.plugin_manager.plugins_with_role("scheduler")[0]
    event(f"preemptions: {'yes' if scheduler.num_preemptions else 'no'}")
    event(f"prefix-cache hits: {'yes' if kv.prefix_cache_hits else 'no'}")
    event(f"steps: {'<50' if step < 50 else '<200' if step < 200 else '>=200'}")
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}, engine


def expected(spec: ReqSpec, limits: Limits) -> tuple[list[int], str]:
    params = make_request(spec.rid, list(spec.prompt), **spec.sampling()).sampling_params
    return expected_scripted_output(list(spec.prompt), params, VOCAB, EOS, limits.max_model_len)


# Properties -----------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(limits=limits_strategy(), specs=workload_strategy())
def test_greedy_outputs_match_the_scripted_reference(limits: Limits, specs: list[ReqSpec]) -> None:
    """Properties 1 and 2: exact greedy outputs, invariants every step, no KV leak."""
    outputs, _ = run_workload(limits, specs)
    for spec in specs:
        assert outputs[spec.rid] == expected(spec, limits), spec


@PROPERTY_SETTINGS
@given(limits=limits_strategy(), specs=workload_strategy(max_requests=8))
def test_prefix_caching_and_async_do_not_change_greedy_outputs(
    limits: Limits, specs: list[ReqSpec]
) -> None:
    """Property 3 (greedy): the four (prefix caching, async) combinations agree."""
    results = {}
    for prefix in (False, True):
        for use_async in (False, True):
            variant = replace(limits, enable_prefix_caching=prefix, async_scheduling=use_async)
            results[prefix, use_async], _ = run_workload(variant, specs)
    reference = {s.rid: expected(s, limits) for s in specs}
    for key, outputs in results.items():
        assert outputs == reference, key


@PROPERTY_SETTINGS
@given(limits=limits_strategy(), specs=workload_strategy(max_requests=6))
def test_seeded_sampling_is_the_same_sync_async_and_across_runs(
    limits: Limits, specs: list[ReqSpec]
) -> None:
    """Property 3 (seeded, temperature 0.8): sync == async == prefix caching off, and a
    second run gives the same outputs."""
    runs = {}
    for name, prefix, use_async in (
        ("sync", limits.enable_prefix_caching, False),
        ("async", limits.enable_prefix_caching, True),
        ("async-other-prefix", not limits.enable_prefix_caching, True),
        ("sync-again", limits.enable_prefix_caching, False),
    ):
        variant = replace(limits, enable_prefix_caching=prefix, async_scheduling=use_async)
        runs[name], _ = run_workload(variant, specs, temperature=0.8)
    for name, outputs in runs.items():
        assert outputs == runs["sync"], name
    for spec in specs:
        tokens, reason = runs["sync"][spec.rid]
        assert reason in ("stop", "length")
        assert 1 <= len(tokens) <= spec.max_tokens
        assert all(0 <= t < VOCAB for t in tokens)


@PROPERTY_SETTINGS
@given(limits=limits_strategy(), specs=workload_strategy(with_aborts=True))
def test_aborts_end_requests_cleanly(limits: Limits, specs: list[ReqSpec]) -> None:
    """Property 4: an aborted request ends with "abort" and a prefix of its expected tokens
    (or its full output, when it finished before the abort was drained); every other
    request is exact; nothing leaks (checked by `run_workload`)."""
    outputs, _ = run_workload(limits, specs)
    for spec in specs:
        want_tokens, want_reason = expected(spec, limits)
        tokens, reason = outputs[spec.rid]
        if spec.abort_at is None:
            assert (tokens, reason) == (want_tokens, want_reason), spec
        elif reason == "abort":
            event(f"aborted {'after' if tokens else 'before'} its first token")
            assert len(tokens) < len(want_tokens), spec
            assert tokens == want_tokens[: len(tokens)], spec
        else:
            assert (tokens, reason) == (want_tokens, want_reason), spec
