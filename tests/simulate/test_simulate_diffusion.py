"""`tandem simulate` on a block-diffusion stack: canvas steps from `DiffusionTokenOracle`,
priced by the canvas-aware roofline.

The oracle is checked against the scripted diffusion model run through the real worker and
diffusion runner (same scheduler outputs and token times, step for step, with preemption,
prefix caching, sync and async); the denoising model against the scripted model's closed
form; the step shape and the roofline's canvas terms against hand-computed FLOPs; and the
simulated latencies against the denoising-step count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tandem.core.scheduler_output import NewRequestData, SchedulerOutput
from tandem.core.worker.diffusion_oracle import DiffusionTokenOracle
from tandem.core.worker.step_shape import StepShape, step_shape_of
from tandem.core.worker.virtual_device import EngineTime
from tandem.plugins.cost_models.roofline import (
    CostFactors,
    breakdown,
    canvas_keys_attended,
    canvas_keys_read,
)
from tandem.plugins.cost_models.shapes import NAMED_DEVICES, model_shape
from tandem.schema.sampling_params import SamplingParams
from tandem.simulate.cli import main as simulate_main
from tandem.simulate.driver import simulate
from tandem.simulate.traffic import TrafficRequest
from tandem.stack_file import load_config
from tandem.testing.scripted_diffusion import scripted_diffusion_steps

ROOT = Path(__file__).resolve().parents[2]
H100 = NAMED_DEVICES["h100"]


def diffusion_config(**overrides: Any):  # noqa: ANN201
    settings: dict[str, Any] = dict(
        model="scripted-diffusion",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=48,
        block_size=8,
        num_kv_blocks=14,
        enable_prefix_caching=True,
    )
    return load_config(**(settings | overrides))


def mixed_traffic() -> list[TrafficRequest]:
    """A burst (preemption in the 14-block pool) then a trickle; two shared prefixes."""
    return [
        TrafficRequest(0.0 if i < 6 else 0.01 * i, 20 + 7 * (i % 4), 5 + 6 * (i % 3), 0, i % 2, 16)
        for i in range(12)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_diffusion_oracle_schedules_exactly_as_the_diffusion_runner(
    async_scheduling: bool,
) -> None:
    """Scripted diffusion model through the worker vs the oracle with one position fixed per
    step (the scripted model's rule): identical scheduler outputs and token times."""
    config = diffusion_config(async_scheduling=async_scheduling)
    worker, oracle = (
        simulate(
            config,
            mixed_traffic(),
            tokens=tokens,
            engine_time=EngineTime(step_s=2e-4),
            keep_steps=True,
            denoise_tokens_per_step=1,
        )
        for tokens in ("worker", "oracle")
    )
    assert worker.num_preemptions > 0  # the pool is small enough to matter
    assert len(worker.steps) > 50
    assert [(s.num_scheduled_tokens, s.preempted, s.finished) for s in worker.steps] == [
        (s.num_scheduled_tokens, s.preempted, s.finished) for s in oracle.steps
    ]
    assert [t.token_times_s for t in worker.timelines] == [
        t.token_times_s for t in oracle.timelines
    ]
    assert [len(t.token_times_s) for t in oracle.timelines] == [
        r.output_tokens for r in mixed_traffic()
    ]


def test_a_different_denoising_model_gives_different_steps() -> None:
    """The parity above is not vacuous: the default model (every canvas takes
    max_denoising_steps = 8) schedules differently from the scripted rule."""
    config = diffusion_config()
    runs = [
        simulate(config, mixed_traffic(), keep_steps=True, denoise_tokens_per_step=k)
        for k in (1, None)
    ]
    assert [s.num_scheduled_tokens for s in runs[0].steps] != [
        s.num_scheduled_tokens for s in runs[1].steps
    ]
    assert runs[1].num_steps > runs[0].num_steps


@pytest.mark.parametrize("max_steps", [1, 2, 3, 5, 8, 12])
def test_steps_per_canvas_with_one_position_per_step_is_the_scripted_rule(max_steps: int) -> None:
    oracle = DiffusionTokenOracle(max_steps, stability_threshold=1, tokens_per_step=1)
    for length in range(1, 12):
        assert oracle.steps_per_canvas(length) == scripted_diffusion_steps(length, max_steps)


def test_steps_per_canvas_model() -> None:
    assert DiffusionTokenOracle(48).steps_per_canvas(256) == 48  # no adaptive stopping
    fast = DiffusionTokenOracle(48, stability_threshold=1, tokens_per_step=16)
    assert fast.steps_per_canvas(256) == 16  # ceil(256 / 16)
    assert fast.steps_per_canvas(8) == 2  # at least stability_threshold + 1
    assert DiffusionTokenOracle(48, 3, tokens_per_step=64).steps_per_canvas(256) == 4
    with pytest.raises(ValueError, match="denoise_tokens_per_step"):
        DiffusionTokenOracle(48, tokens_per_step=0)
    with pytest.raises(ValueError, match="max_denoising_steps"):
        DiffusionTokenOracle(0)


def test_the_oracle_commits_a_canvas_after_its_steps_and_restarts_after_preemption() -> None:
    oracle = DiffusionTokenOracle(3)
    new = NewRequestData("a", [5] * 10, 10, SamplingParams(), [], num_computed_tokens=0)
    first = SchedulerOutput(step_id=0, scheduled_new_reqs=[new], num_scheduled_tokens={"a": 10})
    assert oracle.step(first).sampled_token_ids == [[]]  # prompt only
    canvas = {"a": [-1] * 4}
    step = SchedulerOutput(
        step_id=1, num_scheduled_tokens={"a": 4}, scheduled_spec_decode_tokens=canvas
    )
    assert [oracle.step(step).sampled_token_ids for _ in range(3)] == [[[]], [[]], [[2] * 4]]
    oracle.step(step)  # one step into the next canvas
    oracle.step(SchedulerOutput(step_id=5, preempted_req_ids={"a"}))
    assert "a" not in oracle.steps_done
    resumed = SchedulerOutput(
        step_id=6,
        scheduled_new_reqs=[new],
        num_scheduled_tokens={"a": 4},
        scheduled_spec_decode_tokens=canvas,
    )
    assert oracle.step(resumed).sampled_token_ids == [[]]  # the canvas starts over
    assert oracle.steps_done["a"] == 1


# Pricing a canvas step -----------------------------------------------------------------


def test_step_shape_of_a_canvas_step() -> None:
    so = SchedulerOutput(
        step_id=3,
        num_scheduled_tokens={"a": 4 + 16, "b": 16, "c": 7},
        scheduled_spec_decode_tokens={"a": [-1] * 16, "b": [-1] * 16},
    )
    shape = step_shape_of(so, diffusion=True)
    assert shape.canvas_lens == (16, 16, 0)
    assert shape.num_sampled == 32  # logits at every canvas position, none elsewhere
    assert shape.pass_tokens() == (4 + 7, 32)  # one encode, one decoder pass of length 16
    autoregressive = step_shape_of(so)
    assert autoregressive.canvas_lens == () and autoregressive.num_sampled == 3
    assert autoregressive.pass_tokens() == (43,)
    with pytest.raises(ValueError, match="canvas_lens"):
        StepShape((4,), (0,), canvas_lens=(1, 2))


def test_the_roofline_prices_a_canvas_bidirectionally() -> None:
    """A 256-position canvas on Llama-3-8B's geometry after 1000 cached tokens: every
    position attends to all 1000 + 256 keys (not the causal 1000 + 257/2), the cached KV
    read is the context only, and every position has logits."""
    llama = model_shape("llama-3-8b")
    f = CostFactors()
    k, n = 256, 1000
    canvas = breakdown(llama, H100, StepShape((k,), (n,), k, canvas_lens=(k,)), f)
    chunk = breakdown(llama, H100, StepShape((k,), (n,), 1), f)
    per_key = 4 * 32 * 32 * 128  # layers x heads x head_dim
    flops = per_key * k * (n + k)
    kv_bytes = 131_072 * n
    expected = max(
        flops / (H100.peak_flops * f.attention_efficiency),
        kv_bytes / (H100.mem_bandwidth * f.bandwidth_efficiency),
    )
    assert canvas["attention"] == pytest.approx(expected, rel=1e-12)
    assert canvas["attention"] > chunk["attention"]
    head = 2 * 4096 * 128256 * k / (H100.peak_flops * f.mfu)
    assert canvas["lm_head"] == pytest.approx(head, rel=1e-12)
    assert canvas["linear"] == pytest.approx(chunk["linear"], rel=1e-12)  # one pass either way


def test_sliding_layers_see_their_window_of_the_context() -> None:
    """diffusion-gemma's 25 sliding layers cap the canvas's context at 1024 tokens: a
    canvas after 100k tokens costs the same attention on them as after 1024."""
    shape = model_shape("diffusion-gemma")
    sliding, full = shape.attention_groups()
    assert sliding.window == 1024 and full.window == 0
    assert canvas_keys_attended(sliding, 100_000, 256) == 256 * (1024 + 256)
    assert canvas_keys_attended(full, 100_000, 256) == 256 * (100_000 + 256)
    assert canvas_keys_read(sliding, 100_000) == 1024
    assert canvas_keys_read(full, 500) == 500


def test_two_passes_read_the_weights_twice() -> None:
    """A step that encodes a commit and denoises a canvas runs two forward passes: at
    small token counts (memory-bound) the linear phase reads the weights twice."""
    shape = model_shape("diffusion-gemma")
    one = breakdown(shape, H100, StepShape((4,), (100,), 4, canvas_lens=(4,)))
    two = breakdown(shape, H100, StepShape((8,), (100,), 4, canvas_lens=(4,)))
    head = shape.lm_head_params() * shape.dtype_bytes / (H100.mem_bandwidth * 0.8)
    assert two["linear"] - head == pytest.approx(2 * (one["linear"] - head), rel=1e-9)


# Latency responds to the denoising model -----------------------------------------------


def gemma_stack(max_denoising_steps: int) -> Any:
    return load_config(
        model="scripted-diffusion",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        block_size=16,
        num_kv_blocks=256,
        diffusion={"canvas_length": 16, "max_denoising_steps": max_denoising_steps},
        plugins=[
            "diffusion-scheduler",
            "diffusion-sampler",
            {"name": "roofline-cost", "options": {"model": "diffusion-gemma", "device": "h100"}},
        ],
    )


def tpot_and_e2e(result: Any) -> tuple[float, float]:
    (timeline,) = result.timelines
    times = timeline.token_times_s
    return (times[-1] - times[0]) / (len(times) - 1), timeline.finish_s - timeline.arrival_s


def test_latency_follows_the_denoising_step_count() -> None:
    """One request, 64 output tokens = 4 canvases of 16: 1 prefill step + 4 x N denoising
    steps; TPOT and E2E grow with N, and fewer steps per canvas (more positions fixed per
    step) shorten them."""
    traffic = [TrafficRequest(0.0, 32, 64)]
    results = {n: simulate(gemma_stack(n), traffic) for n in (4, 16)}
    for n, result in results.items():
        assert result.num_steps == 1 + 4 * n
    (tpot4, e2e4), (tpot16, e2e16) = (tpot_and_e2e(results[n]) for n in (4, 16))
    assert e2e16 > 3 * e2e4 and tpot16 > 3 * tpot4
    faster = simulate(gemma_stack(16), traffic, denoise_tokens_per_step=4)  # 4 steps/canvas
    assert faster.num_steps == 1 + 4 * 4
    assert tpot_and_e2e(faster)[1] == pytest.approx(e2e4, rel=1e-9)


def test_the_cli_runs_the_example_diffusion_stack(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    code = simulate_main(
        [
            "--stack",
            str(ROOT / "examples/simulate/diffusion-async.yaml"),
            "--model",
            "diffusion-gemma",
            "--device",
            "h200",
            "--traffic",
            "poisson:rate=2,n=6,prompt=256,output=512,seed=3",
            "--denoise-tokens-per-step",
            "32",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0
    stack = json.loads(out.read_text())["stacks"]["diffusion-async"]
    assert stack["completed"] == 6 and stack["total_output_tokens"] == 6 * 512
    # each request: a prefill step, then 2 canvases of 256 x 8 steps (ceil(256 / 32));
    # requests share steps, so between one request's 17 and six times that
    assert 17 <= stack["num_steps"] <= 6 * 17
