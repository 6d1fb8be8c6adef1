"""A request whose own data breaks the worker's input preparation ends alone, with an
error naming the field; every other request in the step goes on and the engine keeps
serving (before: "step 0 failed with ValueError" stopped the engine)."""

from __future__ import annotations

import pytest

from tandem.testing import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    make_scripted_engine,
)

PROMPTS = {"a": [3, 4, 5, 6, 7], "b": [9] * 13, "c": [2, 7, 1, 8, 2, 8]}


def expected(prompt: list[int]) -> tuple[list[int], str]:
    from tandem.schema.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return expected_scripted_output(prompt, params, 128, 1, 64)


@pytest.mark.parametrize(
    ("executor", "async_scheduling"),
    [("inprocess", False), ("inprocess", True), ("thread", True), ("process", True)],
)
def test_a_seed_past_64_bits_in_the_worker_ends_only_its_request(
    executor: str, async_scheduling: bool
) -> None:
    engine = make_scripted_engine(
        parallel={"executor": executor},
        async_scheduling=async_scheduling,
        max_num_batched_tokens=16,
        num_kv_blocks=40,
        max_model_len=64,
    )
    try:
        for rid, prompt in PROMPTS.items():
            engine.add_request(make_request(rid, prompt, max_tokens=10, ignore_eos=True))
        bad = make_request("bad", [5, 6, 7], max_tokens=10, temperature=1.0, seed=7)
        engine.add_request(bad)
        # as a plugin or `model_construct` could: past validation, into the worker
        bad.sampling_params = bad.sampling_params.model_copy(update={"seed": 2**70})
        outputs = collect_outputs(engine)
        assert outputs["bad"] == ([], "error")
        for rid, prompt in PROMPTS.items():
            assert outputs[rid] == expected(prompt), rid
        assert engine.dead_error is None
        again = make_request("bad", PROMPTS["a"], max_tokens=10, ignore_eos=True)
        engine.add_request(again)
        assert collect_outputs(engine) == {"bad": expected(PROMPTS["a"])}
    finally:
        engine.shutdown()


def test_the_error_names_the_field() -> None:
    engine = make_scripted_engine(max_model_len=64)
    bad = make_request("bad", [5, 6, 7], max_tokens=4, temperature=1.0, seed=7)
    engine.add_request(bad)
    bad.sampling_params = bad.sampling_params.model_copy(update={"seed": -1})
    errors = []
    while engine.has_unfinished_requests():
        outputs, _ = engine.step_fn()
        errors += [o.error for o in outputs if o.finish_reason == "error"]
    assert len(errors) == 1 and "seed" in errors[0] and "input preparation" in errors[0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_whose_drafting_raises_ends_alone(async_scheduling: bool) -> None:
    """The drafter raises for one request: that request ends with an error naming the
    drafting; the others keep speculating and give the scripted tokens."""
    engine = make_scripted_engine(
        async_scheduling=async_scheduling,
        num_kv_blocks=40,
        max_model_len=64,
        speculative={"method": "scripted", "num_speculative_tokens": 2},
        plugins=[
            {"name": "reference-scheduler"},
            {"name": "default-sampler"},
            {"name": "scripted-drafter", "options": {"num_correct": 1, "fail_for": ["bad"]}},
        ],
    )
    try:
        for rid, prompt in PROMPTS.items():
            engine.add_request(make_request(rid, prompt, max_tokens=10, ignore_eos=True))
        engine.add_request(make_request("bad", [5, 6, 7], max_tokens=10, ignore_eos=True))
        outputs = collect_outputs(engine)
        assert outputs["bad"][1] == "error"
        for rid, prompt in PROMPTS.items():
            assert outputs[rid] == expected(prompt), rid
        assert engine.dead_error is None
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_diffusion_request_whose_inputs_fail_ends_alone(async_scheduling: bool) -> None:
    """The block-diffusion runner isolates input preparation the same way: the request
    with a seed past 64 bits ends with an error naming the seed, the others commit their
    scripted canvases and the engine serves the next request."""
    from tandem.config_resolution import resolve_config
    from tandem.core.engine_core import EngineCore
    from tandem.schema.config import EngineConfig
    from tandem.stack_file import load_config
    from tandem.testing.scripted_diffusion import expected_scripted_diffusion_output

    config = resolve_config(
        load_config(
            EngineConfig(),
            model="scripted-diffusion",
            vocab_size=16,
            max_model_len=32,
            block_size=4,
            check_invariants=True,
            async_scheduling=async_scheduling,
        )
    )
    engine = EngineCore(config)
    prompts = {"a": [3, 4, 5], "b": [9, 9, 9, 9, 9, 2], "c": [2, 7]}
    try:
        for rid, prompt in prompts.items():
            engine.add_request(make_request(rid, prompt, max_tokens=9, seed=3))
        bad = make_request("bad", [5, 6, 7], max_tokens=9, seed=7)
        engine.add_request(bad)
        bad.sampling_params = bad.sampling_params.model_copy(update={"seed": 2**70})
        errors: list[str] = []
        outputs: dict[str, tuple[list[int], str | None]] = {}
        for o in engine.run_until_idle(10_000):
            tokens, _ = outputs.get(o.request_id, ([], None))
            outputs[o.request_id] = (tokens + list(o.new_token_ids), o.finish_reason)
            if o.finish_reason == "error":
                errors.append(o.error or "")
        assert outputs["bad"] == ([], "error")
        assert len(errors) == 1 and "seed" in errors[0] and "input preparation" in errors[0]
        for rid, prompt in prompts.items():
            params = make_request(rid, prompt, max_tokens=9, seed=3).sampling_params
            want = expected_scripted_diffusion_output(prompt, params, engine.config)
            assert outputs[rid] == want, rid
        assert engine.dead_error is None
        engine.add_request(make_request("bad", prompts["a"], max_tokens=9, seed=3))
        assert collect_outputs(engine)["bad"] == outputs["a"]
    finally:
        engine.shutdown()
