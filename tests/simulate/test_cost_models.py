"""The roofline cost model (`roofline-cost`, `plugins/cost_models`) against known figures.

Llama-3-8B bf16 decode at batch 1 on an H100 reads its ~15 GB of linear weights once: about
15e9 / (3.35e12 x 0.8) = 5.6 ms, bandwidth-bound (one more decode request barely costs
anything); a 2048-token prefill is compute-bound and about linear in tokens; an H200 decodes
faster (bandwidth); TP=2 halves a big prefill but adds communication; attention grows with
decode context; an MoE pays FLOPs for its active experts only. The embedded shapes give the
published parameter counts. The plugin is built directly and through a resolved stack.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from tandem.core.plugin_manager import PluginConfigError, TandemPluginManager
from tandem.core.worker.step_shape import StepShape
from tandem.plugins.cost_models.roofline import (
    TERMS,
    CostFactors,
    RooflineCostModel,
    breakdown,
    roofline_seconds,
)
from tandem.plugins.cost_models.shapes import (
    NAMED_DEVICES,
    NAMED_MODEL_CONFIGS,
    AttentionGroup,
    ModelShape,
    device_spec,
    model_shape,
    this_cpu,
)
from tandem.schema.config import EngineConfig
from tandem.testing.engine import scripted_config

LLAMA = model_shape("llama-3-8b")
H100, H200 = NAMED_DEVICES["h100"], NAMED_DEVICES["h200"]


def decode(batch: int, context: int = 100, tp: int = 1, pp: int = 1) -> StepShape:
    return StepShape((1,) * batch, (context,) * batch, batch, tp, pp)


def prefill(tokens: int, tp: int = 1, pp: int = 1) -> StepShape:
    return StepShape((tokens,), (0,), 1, tp, pp)


# The embedded numbers ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("llama-3-8b", 8.03e9),
        ("llama-3-70b", 70.6e9),
        ("qwen3-8b", 8.19e9),
        ("qwen3-32b", 32.8e9),
        ("smollm2-135m", 134.5e6),
        ("diffusion-gemma", 25.2e9),  # the text tower of a 25.2B-total, 3.8B-active MoE
    ],
)
def test_named_shapes_give_the_published_parameter_counts(name: str, published: float) -> None:
    shape = model_shape(name)
    # Resident weights: linear layers, LM head, the embedding table unless tied.
    assert shape.resident_bytes() / shape.dtype_bytes == pytest.approx(published, rel=0.015)


def test_llama3_8b_sizes() -> None:
    assert LLAMA.head_dim == 128
    assert LLAMA.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131_072
    assert LLAMA.weight_bytes() == pytest.approx(15.0e9, rel=0.01)
    assert LLAMA.params_linear() == LLAMA.active_params_linear()  # dense


def test_diffusion_gemma_counts_only_active_experts() -> None:
    shape = model_shape("diffusion-gemma")
    assert shape.is_moe and shape.num_experts == 128 and shape.num_experts_per_tok == 8
    assert shape.active_params_linear() == pytest.approx(3.8e9, rel=0.02)
    assert shape.weight_bytes(1) < shape.weight_bytes(4) < shape.weight_bytes(10_000)
    assert shape.weight_bytes(10_000) == shape.weight_bytes()  # every expert touched
    groups = shape.attention_groups()
    assert [(g.num_layers, g.head_dim, g.num_kv_heads, g.window) for g in groups] == [
        (25, 256, 8, 1024),
        (5, 512, 2, 0),
    ]


# Known figures ------------------------------------------------------------------------


def test_llama3_8b_decode_on_h100_is_bandwidth_bound() -> None:
    seconds = roofline_seconds(LLAMA, H100, decode(1))
    expected = LLAMA.weight_bytes(1) / (H100.mem_bandwidth * 0.8)  # ~15e9 / 2.68e12
    assert 5e-3 < expected < 6e-3
    assert breakdown(LLAMA, H100, decode(1))["linear"] == pytest.approx(expected)
    assert expected <= seconds < expected * 1.01
    # Memory-bound: a second decode request adds well under 1 %.
    assert roofline_seconds(LLAMA, H100, decode(2)) < seconds * 1.01


def test_prefill_is_compute_bound_and_about_linear_in_tokens() -> None:
    terms = breakdown(LLAMA, H100, prefill(2048))
    compute = 2 * LLAMA.layer_params() * 2048 / (H100.peak_flops * 0.6)
    assert terms["linear"] == pytest.approx(compute)  # compute above memory
    assert compute > LLAMA.weight_bytes() / (H100.mem_bandwidth * 0.8)
    ratio = roofline_seconds(LLAMA, H100, prefill(4096)) / roofline_seconds(
        LLAMA, H100, prefill(2048)
    )
    assert 1.9 < ratio < 2.3  # linear, plus attention's quadratic share


def test_h200_decodes_faster_than_h100_by_its_bandwidth() -> None:
    h100 = roofline_seconds(LLAMA, H100, decode(8))
    h200 = roofline_seconds(LLAMA, H200, decode(8))
    assert h200 < h100
    assert h200 / h100 == pytest.approx(3.35 / 4.8, rel=0.02)


def test_tp2_about_halves_a_big_prefill_and_adds_communication() -> None:
    one, two = breakdown(LLAMA, H100, prefill(4096)), breakdown(LLAMA, H100, prefill(4096, 2))
    assert one["tp_comm"] == 0.0 and two["tp_comm"] > 0.0
    assert two["linear"] == pytest.approx(one["linear"] / 2)
    assert two["attention"] == pytest.approx(one["attention"] / 2)
    total_one, total_two = sum(one.values()), sum(two.values())
    assert total_one / 2 < total_two < 0.65 * total_one


def test_attention_grows_with_decode_context() -> None:
    short = breakdown(LLAMA, H100, decode(32, context=1000))["attention"]
    long = breakdown(LLAMA, H100, decode(32, context=8000))["attention"]
    assert long / short == pytest.approx(8001 / 1001, rel=0.01)  # KV bytes read
    assert breakdown(LLAMA, H100, decode(32, 1000))["linear"] == pytest.approx(
        breakdown(LLAMA, H100, decode(32, 8000))["linear"]
    )


def test_moe_pays_flops_for_its_active_experts_only() -> None:
    moe = model_shape("diffusion-gemma")
    every_expert = ModelShape.from_hf_config(
        {**NAMED_MODEL_CONFIGS["diffusion-gemma"]["text_config"], "top_k_experts": 128}
    )
    step = prefill(8192)  # compute-bound, touches every expert
    active = 2 * moe.layer_params(8) * 8192 / (H100.peak_flops * 0.6)
    assert breakdown(moe, H100, step)["linear"] == pytest.approx(active)
    assert roofline_seconds(every_expert, H100, step) > 5 * roofline_seconds(moe, H100, step)
    # Decode of one token reads only the 8 experts it is routed to.
    one = breakdown(moe, H100, decode(1))["linear"]
    assert one == pytest.approx(moe.weight_bytes(1) / (H100.mem_bandwidth * 0.8))


def test_sliding_window_caps_the_keys() -> None:
    for window in (0, 3, 7):
        group = AttentionGroup(1, 64, 1, window)
        for context in (0, 2, 5, 12):
            for query in (1, 2, 4, 9):
                positions = range(context + 1, context + query + 1)
                brute = sum(min(k, window) if window else k for k in positions)
                assert group.keys_attended(context, query) == brute
    assert AttentionGroup(1, 64, 1, 1024).keys_read(100_000, 1) == 1024


def test_pipeline_stages_run_in_turn_and_pay_the_sends() -> None:
    one, two = breakdown(LLAMA, H100, prefill(2048)), breakdown(LLAMA, H100, prefill(2048, pp=2))
    assert two["linear"] == pytest.approx(one["linear"])  # sum of the stages' times
    assert one["pp_comm"] == 0.0 and two["pp_comm"] > 0.0
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        roofline_seconds(LLAMA, H100, prefill(16, pp=64))


def test_an_empty_step_costs_nothing() -> None:
    factors = CostFactors(step_overhead_s=2e-3)
    assert roofline_seconds(LLAMA, H100, StepShape((), ()), factors) == 0.0
    assert roofline_seconds(LLAMA, H100, StepShape((0,), (10,)), factors) == 0.0
    terms = breakdown(LLAMA, H100, decode(4), factors)
    assert tuple(terms) == TERMS and terms["overhead"] == 2e-3
    assert sum(terms.values()) == roofline_seconds(LLAMA, H100, decode(4), factors)


# Configs ------------------------------------------------------------------------------


def test_from_hf_config_reads_a_nested_text_config() -> None:
    config = {
        "model_type": "llava",
        "tie_word_embeddings": True,
        "vocab_size": 1000,  # the top level's key is a fallback
        "text_config": {
            "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": None, "vocab_size": 32000,
            "num_local_experts": 4, "num_experts_per_tok": 2,
        },
    }  # fmt: skip
    shape = ModelShape.from_hf_config(config)
    assert (shape.hidden_size, shape.vocab_size, shape.head_dim) == (256, 32000, 32)
    assert shape.num_key_value_heads == 8  # None: as many as heads
    assert shape.tie_word_embeddings and shape.name == "llava"
    assert (shape.num_experts, shape.num_experts_per_tok, shape.shared_intermediate_size) == (
        4,
        2,
        0,
    )
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf_config({"text_config": {"num_attention_heads": 8}})


def test_from_hf_config_reads_shared_experts_and_window_patterns() -> None:
    base = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 12,
        "num_attention_heads": 4, "vocab_size": 100,
    }  # fmt: skip
    qwen2_moe = {**base, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    shape = ModelShape.from_hf_config({**qwen2_moe, "shared_expert_intermediate_size": 256})
    assert (shape.moe_intermediate_size, shape.shared_intermediate_size) == (32, 256)
    pattern = ModelShape.from_hf_config({**base, "sliding_window": 16, "sliding_window_pattern": 6})
    assert (pattern.sliding_window, pattern.num_sliding_layers) == (16, 10)
    # Qwen-style: a window value that the config switches off.
    off = ModelShape.from_hf_config({**base, "sliding_window": 16, "use_sliding_window": False})
    assert off.num_sliding_layers == 0 and len(off.attention_groups()) == 1


# The plugin ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"device": "tpu-v9"}, "device"),
        ({"model": "gpt-5"}, "model"),
        ({"mfu": 1.5}, "mfu"),
        ({"bandwidth_efficiency": 0.0}, "bandwidth_efficiency"),
        ({"step_overhead_s": -1.0}, "step_overhead_s"),
        ({"modle": "llama-3-8b"}, "modle"),
        ({"model": "qwen3-8b", "model_config_path": "x.json"}, "model_config_path"),
    ],
)
def test_bad_options_name_the_option(options: dict, named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        RooflineCostModel.Options(**options)


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="h100") as caught:
        RooflineCostModel.Options(device="tpu-v9")
    assert "tpu-v9" in str(caught.value) and "b200" in str(caught.value)
    with pytest.raises(ValueError, match="qwen3-32b"):
        model_shape("gpt-5")
    with pytest.raises(ValueError, match="a100"):
        device_spec("tpu-v9")


def test_the_plugin_answers_step_cost() -> None:
    plugin = RooflineCostModel(EngineConfig(), RooflineCostModel.Options(device="h200"))
    step = decode(4, context=500)
    assert plugin.step_cost(step=step) == roofline_seconds(LLAMA, H200, step, CostFactors())
    assert plugin.breakdown(step)["linear"] > 0


def test_the_plugin_reads_an_operator_config_file(tmp_path: Path) -> None:
    path = tmp_path / "smol" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(NAMED_MODEL_CONFIGS["smollm2-135m"]))
    options = RooflineCostModel.Options(model_config_path=str(path), dtype_bytes=4)
    plugin = RooflineCostModel(EngineConfig(), options)
    named = model_shape("smollm2-135m", dtype_bytes=4)
    assert plugin.shape.weight_bytes() == named.weight_bytes()
    assert plugin.shape.dtype_bytes == 4 and plugin.shape.name == "smol"
    missing = RooflineCostModel.Options(model_config_path=str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match="model_config_path"):
        RooflineCostModel(EngineConfig(), missing)


def test_the_plugin_runs_from_a_resolved_stack() -> None:
    cost = {"name": "roofline-cost", "options": {"device": "h200", "step_overhead_s": 2e-3}}
    config = scripted_config(plugins=["reference-scheduler", "default-sampler", cost])
    manager = TandemPluginManager(config, side="worker")
    step = decode(2)
    expected = roofline_seconds(LLAMA, H200, step, CostFactors(step_overhead_s=2e-3))
    assert manager.hook.step_cost(step=step) == pytest.approx(expected)
    bad = {"name": "roofline-cost", "options": {"device": "tpu-v9"}}
    with pytest.raises(PluginConfigError, match="device"):
        scripted_config(plugins=["reference-scheduler", "default-sampler", bad])


def test_this_cpu_is_measured_once() -> None:
    cpu = this_cpu()
    assert cpu is this_cpu() is device_spec("cpu")
    assert cpu.peak_flops > 1e8 and cpu.mem_bandwidth > 1e8 and cpu.mem_bytes >= 0
    plugin = RooflineCostModel(
        EngineConfig(), RooflineCostModel.Options(model="smollm2-135m", device="cpu")
    )
    assert plugin.step_cost(step=decode(1)) > 0
