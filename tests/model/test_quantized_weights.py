"""Weight-only quantization: GGUF blocks kept bit for bit, the quantized kernel against a
float reference, and greedy parity of quantized engines with transformers run on the same
(dequantized) weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tandem import LLM, SamplingParams
from tandem.models.panel_linear import panel_gemm_kernel
from tandem.models.quant_linear import QuantEmbedding, QuantLinear
from tandem.models.quantized_weight import (
    QuantizedWeight,
    from_gguf_blocks,
    quantize_int4,
    quantize_int8,
)
from tandem.testing.tiny_model import TINY_ARCHS

KERNEL = panel_gemm_kernel()
#: The kept types of 32-element blocks, which gguf quantizes itself (the K-quants:
#: test_kquant_weights.py).
BLOCK32_TYPES = ("Q4_0", "Q4_1", "Q8_0")
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: the kernel path")


def _weight(out: int, inn: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(out, inn, generator=generator) * 0.05


def _gguf_blocks(kind: str, weight: torch.Tensor) -> np.ndarray:
    return gguf_quantize(weight.numpy(), GGMLQuantizationType[kind])


def _formats(out: int = 40, inn: int = 96) -> list[QuantizedWeight]:
    weight = _weight(out, inn)
    made = [quantize_int8(weight), quantize_int8(weight, 32), quantize_int8(weight, 64)]
    made += [quantize_int4(weight, g) for g in (32, 64, 128)]
    made += [from_gguf_blocks(k, _gguf_blocks(k, weight), (out, inn)) for k in BLOCK32_TYPES]
    return made


@pytest.mark.parametrize("kind", BLOCK32_TYPES)
def test_gguf_blocks_dequantize_bit_exact(kind: str) -> None:
    weight = _weight(48, 160, seed=3)
    blocks = _gguf_blocks(kind, weight)
    kept = from_gguf_blocks(kind, blocks, (48, 160))
    reference = torch.from_numpy(gguf_dequantize(blocks, GGMLQuantizationType[kind]))
    assert kept.kind == kind and kept.bits == (8 if kind == "Q8_0" else 4)
    assert torch.equal(kept.dequantize(), reference)
    linear = QuantLinear(kept)
    assert torch.equal(linear.dense_weight(), reference)
    assert torch.equal(linear.rows(torch.tensor([0, 47, 5])), reference[[0, 47, 5]])


@needs_kernel
@pytest.mark.parametrize("portable", [False, True])
def test_kernel_uses_exactly_the_dequantized_weights(portable: bool) -> None:
    """x = rows of the identity: every output is one weight times 1 plus zeros, so any
    difference from `dequantize()` is a wrong weight, not summation order."""
    for weight in _formats():
        linear = QuantLinear(weight)
        dense = weight.dequantize()
        for rows in (1, 3, 96):  # the register path and the dequantized-panel path
            eye = torch.eye(96)[:rows]
            assert torch.equal(linear.run(eye, portable), dense.t()[:rows]), (weight.kind, rows)


def test_gguf_type_not_kept_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="Q5_K is not kept quantized"):
        from_gguf_blocks("Q5_K", np.zeros((1, 176), np.uint8), (1, 256))


def test_quantization_error_is_at_most_half_a_step() -> None:
    weight = _weight(24, 100, seed=5)  # 100 inputs: a short last int4 group
    int8 = quantize_int8(weight)
    step = int8.scales.expand(-1, 100)
    assert ((int8.dequantize() - weight).abs() <= step / 2 + 1e-7).all()
    assert int8.codes.dtype == torch.uint8 and 1 <= int8.codes.min() <= int8.codes.max() <= 255
    grouped = quantize_int8(weight, 32)
    step = grouped.scales.repeat_interleave(32, dim=1)[:, :100]
    assert ((grouped.dequantize() - weight).abs() <= step / 2 + 1e-6).all()
    for group in (32, 64, 128):
        int4 = quantize_int4(weight, group)
        assert int4.codes.max() <= 15 and int4.scales.shape == (24, -(-100 // group))
        step = int4.scales.repeat_interleave(group, dim=1)[:, :100]
        assert ((int4.dequantize() - weight).abs() <= step / 2 + 1e-6).all()
    for values in (int8.scales, int4.scales, int4.mins):  # float16 values in float32
        assert torch.equal(values, values.half().float())


def test_bad_group_size_and_non_finite_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        quantize_int4(_weight(4, 64), 48)
    bad = _weight(4, 64)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_int8(bad)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 13, 64])
@pytest.mark.parametrize("portable", [False, True])
def test_quant_linear_matches_float64_reference(rows: int, portable: bool) -> None:
    if portable and KERNEL is None:
        pytest.skip("no C++ compiler: the fallback is F.linear")  # covered by rows=any
    generator = torch.Generator().manual_seed(rows)
    for weight in _formats(out=40, inn=96):
        bias = torch.randn(40, generator=generator)
        linear = QuantLinear(weight, bias)
        x = torch.randn(rows, 96, generator=generator)
        y = linear.run(x, portable) if KERNEL is not None else linear(x)
        dense = weight.dequantize().double()
        expected = x.double() @ dense.t() + bias.double()
        bound = 1e-5 * ((x.double().abs() @ dense.abs().t()) + bias.abs().double()) + 1e-6
        assert ((y.double() - expected).abs() <= bound).all(), (weight.kind, rows)


@needs_kernel
def test_two_threads_give_the_same_product(two_threads) -> None:
    weight = quantize_int4(_weight(200, 128, seed=8), 32)
    linear = QuantLinear(weight)
    x = torch.randn(9, 128)
    many = linear(x)
    torch.set_num_threads(1)
    one = linear(x)
    assert torch.allclose(many, one, rtol=1e-5, atol=1e-6)


def test_embedding_over_a_quantized_table_is_exact() -> None:
    weight = from_gguf_blocks("Q8_0", _gguf_blocks("Q8_0", _weight(50, 64)), (50, 64))
    embedding = QuantEmbedding(QuantLinear(weight))
    ids = torch.tensor([[3, 49], [0, 3]])
    assert embedding.weight.is_meta and embedding.weight.shape == (50, 64)
    assert torch.equal(embedding(ids), weight.dequantize()[ids])


def test_int8_groups_follow_a_4_bit_grid() -> None:
    """A float weight that is a dequantized Q4_1 (the embedded model's layers) lies on a
    15-step grid per group of 32: the int8 min/max grid of 255 steps (17 per 4-bit step)
    follows it up to the float16 rounding of its scale, far closer than per channel."""
    q4 = from_gguf_blocks("Q4_1", _gguf_blocks("Q4_1", _weight(16, 64, seed=2)), (16, 64))
    dense = q4.dequantize()
    int8 = quantize_int8(dense, 32)
    error = (int8.dequantize() - dense).abs().max()
    per_channel = (quantize_int8(dense).dequantize() - dense).abs().max()
    assert error < per_channel / 4, (float(error), float(per_channel))


def test_fused_rows_keep_one_format_or_refuse_two() -> None:
    """Rows of one format stack as they are; of two, in their exact common format (widest
    codes, common groups); weights of different input sizes are refused."""
    a, b = quantize_int8(_weight(8, 64)), quantize_int8(_weight(4, 64, seed=1))
    fused = QuantizedWeight.cat([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    c = quantize_int4(_weight(4, 64), 32)
    mixed = QuantizedWeight.cat([a, c])
    assert (mixed.bits, mixed.group_size) == (8, 32)
    assert torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), c.dequantize()]))
    with pytest.raises(ValueError, match="different formats"):
        QuantizedWeight.cat([a, quantize_int4(_weight(4, 96), 32)])


def _dequantized_reference(model_dir: Path, target: Path, mode: str, group: int) -> Path:
    """The tiny model with every decoder linear replaced by its quantized-then-dequantized
    weight (the LM head int8 per channel, as tandem quantizes it): what tandem's quantized
    engine must match token for token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)

    def quantize(weight: torch.Tensor, head: bool) -> QuantizedWeight:
        if mode == "int4" and not head:
            return quantize_int4(weight, group)
        return quantize_int8(weight, group or None)

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                chosen = lambda w, h=(name == "lm_head"): quantize(w, h)  # noqa: E731
                module.weight.copy_(chosen(module.weight).dequantize())
    model.save_pretrained(target)
    return target


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize(
    ("mode", "group"), [("int8", 0), ("int8", 32), ("int4", 32), ("int4", 128)]
)
def test_quantized_engine_matches_transformers_on_dequantized_weights(
    arch: str, mode: str, group: int, tiny_models, hf_greedy, tmp_path: Path
) -> None:
    reference = _dequantized_reference(tiny_models[arch], tmp_path / "ref", mode, group)
    prompts = [[5, 17, 99, 3, 250, 41, 7], list(range(30, 75))]
    llm = LLM(
        model=str(tiny_models[arch]),
        quantization=mode,
        quantization_group_size=group,
        max_model_len=128,
        num_kv_blocks=64,
        block_size=4,
        enable_prefix_caching=True,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.outputs[0].token_ids) == hf_greedy(reference, prompt, 12)
    finally:
        llm.engine.shutdown()


def test_quantization_off_the_cpu_is_refused_naming_the_field() -> None:
    from tandem.models.hf_loader import linear_quantization
    from tandem.schema.config import ConfigError, EngineConfig

    config = EngineConfig.model_validate({"model": {"quantization": "int4"}})
    assert linear_quantization(config, torch.device("cpu")).mode == "int4"
    with pytest.raises(ConfigError, match="model.quantization: int4 runs on the CPU"):
        linear_quantization(config, torch.device("cuda"))
    auto = EngineConfig.model_validate({"model": {"quantization": "auto"}})
    assert linear_quantization(auto, torch.device("cuda")).mode == "none"
    assert linear_quantization(auto, torch.device("cpu")).keeps_gguf
    per_channel = EngineConfig.model_validate(
        {"model": {"quantization": "int4", "quantization_group_size": 0}}
    )
    with pytest.raises(ConfigError, match="quantization_group_size: int4 needs groups"):
        linear_quantization(per_channel, torch.device("cpu"))


def test_smollm2_gguf_weights_are_kept_bit_for_bit(smollm2_dir: Path) -> None:
    """Every Q4_1 / Q8_0 tensor of the embedded GGUF, read by name with Q/K rows put back
    in HF order, dequantizes to exactly the converted float32 checkpoint's tensor."""
    from tandem.models.checkpoint_shards import CheckpointShards
    from tandem.models.gguf_weights import GGUFShards, gguf_source
    from tandem.models.model_files import embedded_gguf_path, load_hf_config

    source = gguf_source(smollm2_dir)
    assert source == embedded_gguf_path().resolve()
    floats = CheckpointShards(smollm2_dir)
    config = load_hf_config(smollm2_dir)
    names = [*floats.files, "lm_head.weight"]
    shards = GGUFShards(source, floats, config, names)
    assert shards.kept_types == {"Q4_1": 7 * config.num_hidden_layers, "Q8_0": 1}
    checked = 0
    for name in floats.files:
        if shards.is_quantized(name):
            assert torch.equal(shards.quantized(name).dequantize(), floats.rows(name)), name
            checked += 1
    assert checked == 7 * config.num_hidden_layers + 1
