"""The diffusion scheduler on the scripted diffusion model: exact committed tokens.

Random workloads (hypothesis) under sync and async scheduling, tiny KV pools (preemption
mid-canvas), chunked prefill, prefix caching, max_tokens, EOS and stop tokens inside a
canvas, the max_model_len edge; ledger and KV invariants every step (`check_invariants`),
no block held at the end. Async equals sync because both equal the closed form.
"""

from __future__ import annotations

from typing import Any

from budget import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore
from tandem.schema.config import EngineConfig
from tandem.stack_file import load_config
from tandem.testing.engine import collect_outputs, make_request
from tandem.testing.scripted_diffusion import (
    expected_scripted_diffusion_output,
    scripted_diffusion_steps,
)

DEFAULTS: dict[str, Any] = {
    "model": "scripted-diffusion",
    "vocab_size": 16,
    "max_model_len": 32,
    "block_size": 4,
    "check_invariants": True,
    "async_scheduling": False,
}


def diffusion_engine(diffusion: dict[str, Any] | None = None, **overrides: Any) -> EngineCore:
    base = EngineConfig.model_validate({"diffusion": diffusion or {}})
    return EngineCore(resolve_config(load_config(base, **{**DEFAULTS, **overrides})))


def expected(engine: EngineCore, prompt: list[int], **params: Any) -> tuple[list[int], str]:
    sampling = make_request("x", prompt, **params).sampling_params
    return expected_scripted_diffusion_output(prompt, sampling, engine.config)


def assert_idle_and_free(engine: EngineCore) -> None:
    state = engine.scheduler_state
    assert not state.requests and not state.running and not state.waiting
    assert state.kv_cache_manager.all_blocks_free()


request_st = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(2, 15), min_size=1, max_size=10),
        "max_tokens": st.integers(1, 14),
        "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(st.integers(2, 15), max_size=1),
        "seed": st.integers(0, 2**32),
    }
)


@settings(max_examples=examples(200), deadline=None)
@given(
    requests=st.lists(request_st, min_size=1, max_size=5),
    canvas_length=st.sampled_from([2, 3, 4]),
    num_kv_blocks=st.integers(8, 16),
    budget_extra=st.integers(0, 12),
    threshold=st.sampled_from([0, 2, 3]),
    prefix_caching=st.booleans(),
    async_scheduling=st.booleans(),
    max_num_seqs=st.integers(1, 4),
)
def test_random_workloads_commit_exactly_the_scripted_canvases(
    requests: list[dict[str, Any]],
    canvas_length: int,
    num_kv_blocks: int,
    budget_extra: int,
    threshold: int,
    prefix_caching: bool,
    async_scheduling: bool,
    max_num_seqs: int,
) -> None:
    engine = diffusion_engine(
        {"canvas_length": canvas_length},
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=canvas_length + budget_extra,
        long_prefill_token_threshold=threshold,
        enable_prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
        max_num_seqs=max_num_seqs,
    )
    for i, r in enumerate(requests):
        params = {k: v for k, v in r.items() if k != "prompt"}
        engine.add_request(make_request(f"r{i}", r["prompt"], **params))
    outputs = collect_outputs(engine, max_steps=5000)
    for i, r in enumerate(requests):
        params = {k: v for k, v in r.items() if k != "prompt"}
        assert outputs[f"r{i}"] == expected(engine, r["prompt"], **params), f"r{i}"
    assert_idle_and_free(engine)


def test_each_canvas_takes_the_scripted_number_of_steps() -> None:
    """One request, no preemption: 2 canvases of 4, 4 denoising steps each, fused encode."""
    engine = diffusion_engine({"canvas_length": 4}, max_model_len=64, num_kv_blocks=16)
    engine.add_request(make_request("a", [3, 4, 5, 6, 7], max_tokens=8, ignore_eos=True))
    outputs = collect_outputs(engine)
    assert outputs["a"] == expected(engine, [3, 4, 5, 6, 7], max_tokens=8, ignore_eos=True)
    stats = engine.stats()["diffusion"]
    assert stats["commits"] == 2
    assert stats["denoising_steps"] == 2 * scripted_diffusion_steps(4, 8)
    # prefill (1) + 4 steps of canvas 0 + 4 of canvas 1 (its first fused with the encode)
    assert stats["engine_steps"] == 1 + 2 * scripted_diffusion_steps(4, 8)
    assert_idle_and_free(engine)


def test_max_denoising_steps_commits_the_argmax_canvas() -> None:
    engine = diffusion_engine({"canvas_length": 4, "max_denoising_steps": 2}, num_kv_blocks=16)
    engine.add_request(make_request("a", [9, 9, 9], max_tokens=6, ignore_eos=True))
    assert collect_outputs(engine)["a"] == expected(
        engine, [9, 9, 9], max_tokens=6, ignore_eos=True
    )
    assert engine.stats()["diffusion"]["denoising_steps"] == 4


def test_canvas_shrinks_at_max_model_len() -> None:
    engine = diffusion_engine({"canvas_length": 4}, max_model_len=10, num_kv_blocks=4)
    prompt = [2, 3, 4, 5, 6, 7, 8]
    engine.add_request(make_request("a", prompt, max_tokens=50, ignore_eos=True))
    tokens, reason = collect_outputs(engine)["a"]
    assert (tokens, reason) == expected(engine, prompt, max_tokens=50, ignore_eos=True)
    assert len(tokens) == 3 and reason == "length"


def test_a_canvas_waits_when_the_budget_cannot_take_it() -> None:
    """Budget = L: a prompt chunk and a canvas never share a step; outputs unchanged."""
    engine = diffusion_engine({"canvas_length": 4}, max_num_batched_tokens=4, num_kv_blocks=16)
    prompts = {"a": [2, 3, 4, 5, 6, 7], "b": [8, 9, 10]}
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, max_tokens=9, ignore_eos=True))
    outputs = collect_outputs(engine)
    for rid, prompt in prompts.items():
        assert outputs[rid] == expected(engine, prompt, max_tokens=9, ignore_eos=True)


def test_prefix_cache_hits_after_a_commit_are_read_back() -> None:
    """The second request's prompt is the first's prompt + its committed tokens: the
    committed blocks are cached after their encode and hit; canvas slots never are."""
    engine = diffusion_engine(
        {"canvas_length": 4}, enable_prefix_caching=True, num_kv_blocks=16, max_model_len=64
    )
    prompt = [3, 5, 7, 9, 11, 13, 2, 4]
    engine.add_request(make_request("a", prompt, max_tokens=8, ignore_eos=True))
    first, _ = collect_outputs(engine)["a"]
    second = prompt + first
    engine.add_request(make_request("b", second, max_tokens=4, ignore_eos=True))
    outputs = engine.run_until_idle(1000)
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert (tokens, outputs[-1].finish_reason) == expected(
        engine, second, max_tokens=4, ignore_eos=True
    )
    # prompt 8 + 8 committed = 16 tokens, blocks of 4: 3 full blocks hit (never the last token)
    assert outputs[-1].num_cached_tokens == 12
    assert engine.scheduler_state.kv_cache_manager.all_blocks_free()


def run_with_abort(async_scheduling: bool, abort_after: int) -> dict[str, Any]:
    engine = diffusion_engine(
        {"canvas_length": 3}, async_scheduling=async_scheduling, num_kv_blocks=16
    )
    prompts = {"a": [2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 10]}
    for rid, prompt in prompts.items():
        engine.add_request(make_request(rid, prompt, max_tokens=12, ignore_eos=True))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    for step in range(500):
        if step == abort_after:
            engine.abort_requests(["b"])
        if not engine.has_work():
            break
        for out in engine.step_fn()[0]:
            got[out.request_id].extend(out.new_token_ids)
    assert not engine.has_work()
    assert_idle_and_free(engine)
    for rid in ("a", "c"):
        assert (got[rid], "length") == expected(
            engine, prompts[rid], max_tokens=12, ignore_eos=True
        )
    full, _ = expected(engine, prompts["b"], max_tokens=12, ignore_eos=True)
    assert got["b"] == full[: len(got["b"])]
    return got


def test_aborts_in_flight_sync_and_async() -> None:
    for abort_after in (0, 1, 2, 3, 5, 8):
        sync = run_with_abort(False, abort_after)
        asyn = run_with_abort(True, abort_after)
        assert sync["a"] == asyn["a"] and sync["c"] == asyn["c"]


def test_preemption_mid_canvas_restarts_it_with_the_same_outputs() -> None:
    for async_scheduling in (False, True):
        engine = diffusion_engine(
            {"canvas_length": 4}, num_kv_blocks=8, async_scheduling=async_scheduling
        )
        prompts = {f"r{i}": [2 + i, 3, 4, 5 + i, 6] for i in range(4)}
        for rid, prompt in prompts.items():
            engine.add_request(make_request(rid, prompt, max_tokens=20, ignore_eos=True))
        outputs = collect_outputs(engine)
        for rid, prompt in prompts.items():
            assert outputs[rid] == expected(engine, prompt, max_tokens=20, ignore_eos=True)
        scheduler = engine.plugin_manager.plugins_with_role("scheduler")[0]
        assert scheduler.num_preemptions > 0
        assert_idle_and_free(engine)
