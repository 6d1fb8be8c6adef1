"""The scripted diffusion model behind every front door: keyword overrides
(`diffusion` / vLLM's `diffusion_config`), the process executor (worker in another
process), `tandem.LLM` and `AsyncLLM` (an engine-core process): the same committed tokens
as `expected_scripted_diffusion_output`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tandem import LLM
from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore
from tandem.engine import AsyncLLM
from tandem.schema.config import ConfigError, EngineConfig
from tandem.schema.sampling_params import SamplingParams
from tandem.stack_file import load_config
from tandem.testing.engine import collect_outputs, make_request
from tandem.testing.scripted_diffusion import expected_scripted_diffusion_output

PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [2], [6, 6, 6, 6, 6, 6, 6]]
BASE: dict[str, Any] = {
    "model": "scripted-diffusion",
    "vocab_size": 16,
    "max_model_len": 32,
    "block_size": 4,
    "worker_num_threads": 1,
}


def expected_all(config: EngineConfig, params: SamplingParams) -> list[list[int]]:
    return [expected_scripted_diffusion_output(p, params, config)[0] for p in PROMPTS]


@pytest.mark.parametrize("key", ["diffusion", "diffusion_config"])
def test_keyword_override_sets_the_diffusion_section(key: str) -> None:
    config = resolve_config(load_config(None, **BASE, **{key: {"canvas_length": 5}}))
    assert config.diffusion is not None and config.diffusion.canvas_length == 5
    assert config.diffusion.max_denoising_steps == 8  # the model's default fills the rest


@pytest.mark.parametrize("key", ["diffusion", "diffusion_config"])
def test_bad_key_inside_the_section_is_named(key: str) -> None:
    with pytest.raises(ConfigError, match=r"diffusion\.canvas_lenght: unknown field"):
        load_config(None, **BASE, **{key: {"canvas_lenght": 5}})


def run_engine(executor: str, async_scheduling: bool) -> tuple[dict[str, Any], EngineConfig, int]:
    """Outputs, config and preemptions of four requests on a pool too small for them."""
    config = resolve_config(
        load_config(
            None,
            **BASE,
            executor=executor,
            num_kv_blocks=8,  # one max-length sequence: preemption mid-canvas
            max_num_batched_tokens=8,
            async_scheduling=async_scheduling,
            diffusion={"canvas_length": 3},
        )
    )
    engine = EngineCore(config)
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(make_request(f"r{i}", prompt, max_tokens=12, seed=i))
        outputs = collect_outputs(engine, max_steps=1000)
        return outputs, config, int(engine.stats()["num_preemptions"])
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_process_executor_equals_in_process(async_scheduling: bool) -> None:
    in_process, config, preemptions = run_engine("inprocess", async_scheduling)
    other, _, other_preemptions = run_engine("process", async_scheduling)
    assert other == in_process
    assert preemptions > 0 and other_preemptions > 0  # canvases restarted after recompute
    params = make_request("x", [2], max_tokens=12).sampling_params
    want = [expected_scripted_diffusion_output(p, params, config) for p in PROMPTS]
    assert [in_process[f"r{i}"] for i in range(len(PROMPTS))] == want


def test_llm_generate_equals_the_closed_form() -> None:
    llm = LLM(**BASE, diffusion_config={"canvas_length": 3, "max_denoising_steps": 4})
    try:
        params = SamplingParams(max_tokens=10, seed=7)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected_all(llm.config, params)
    finally:
        llm.shutdown()


def test_async_llm_streams_the_closed_form() -> None:
    engine = AsyncLLM(**BASE, diffusion={"canvas_length": 3})
    params = SamplingParams(max_tokens=10)

    async def one(prompt: list[int], rid: str) -> list[int]:
        final = None
        async for out in engine.generate(prompt, params, rid):
            final = out
        assert final is not None and final.finished
        return list(final.outputs[0].token_ids)

    async def main() -> list[list[int]]:
        runs = [one(p, f"a{i}") for i, p in enumerate(PROMPTS)]
        return list(await asyncio.wait_for(asyncio.gather(*runs), timeout=60))

    try:
        assert asyncio.run(main()) == expected_all(engine.config, params)
    finally:
        engine.shutdown()
