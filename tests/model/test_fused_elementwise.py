"""The decoder's fused element-wise kernels (`decoder_elementwise`, `csrc/fused_ops.cpp`).

Each compiled op against the torch expression it replaces (to float rounding, on single
rows, odd widths and the multi-threaded path); the rotary table's rows bit-equal to the
rotary module's; the argument checks; and greedy parity with transformers' `generate()` for
RoPE-scaled tiny Llamas (llama3 and dynamic rotary types), which the shared parity tests
do not cover.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.llm import LLM
from tandem.models.decoder_elementwise import (
    FusedElementwise,
    RotaryTable,
    TorchElementwise,
    pick_elementwise,
)
from tandem.models.fused_ops import fused_ops
from tandem.schema.sampling_params import SamplingParams
from tandem.testing.tiny_model import TINY_VOCAB, tiny_config

OPS = fused_ops()
needs_kernels = pytest.mark.skipif(OPS is None, reason="no C++ compiler: torch ops are used")
TORCH = TorchElementwise()
SHAPES = [(1, 576), (5, 33), (300, 576)]  # the last one crosses the threading threshold


@pytest.fixture()
def fused() -> FusedElementwise:
    assert OPS is not None
    return FusedElementwise(OPS)


@needs_kernels
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_norms_match_torch(fused: FusedElementwise, rows: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(rows * cols)
    x, delta = torch.randn(rows, cols, generator=gen), torch.randn(rows, cols, generator=gen)
    weight = torch.randn(cols, generator=gen)
    torch.testing.assert_close(
        fused.rms_norm(x, weight, 1e-6), TORCH.rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-5
    )
    h_fused, h_torch = x.clone(), x.clone()
    out = fused.add_rms_norm_(h_fused, delta, weight, 1e-6)
    torch.testing.assert_close(h_fused, x + delta, rtol=0, atol=0)
    torch.testing.assert_close(
        out, TORCH.add_rms_norm_(h_torch, delta, weight, 1e-6), rtol=1e-5, atol=1e-5
    )


@needs_kernels
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_silu_mul_matches_torch(fused: FusedElementwise, rows: int, cols: int) -> None:
    gate_up = 4 * torch.randn(rows, 2 * cols, generator=torch.Generator().manual_seed(cols))
    torch.testing.assert_close(
        fused.silu_mul(gate_up), TORCH.silu_mul(gate_up), rtol=1e-5, atol=1e-6
    )


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,cols", [*SHAPES, (2048, 576)])
def test_bf16_operand_variants_equal_the_float32_kernels_and_torch_casts(
    fused: FusedElementwise, rows: int, cols: int, threads: int
) -> None:
    """The bf16 path's ops (bfloat16 inputs from and outputs to bf16 GEMMs) give the bits
    of the float32 kernel with torch's casts around it: what the decoder did before."""
    assert OPS is not None
    gen = torch.Generator().manual_seed(rows + cols)
    x = 5 * torch.randn(rows, cols, generator=gen)
    weight = torch.randn(cols, generator=gen)
    delta = torch.randn(rows, cols, generator=gen).bfloat16()
    gate_up = (4 * torch.randn(rows, 2 * cols, generator=gen)).bfloat16()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want_norm = OPS.rms_norm(x, weight, 1e-6).bfloat16()
        assert torch.equal(fused.rms_norm_bf16(x, weight, 1e-6), want_norm)
        assert torch.equal(OPS.rms_norm_bf16(x, weight, 1e-6), want_norm)
        h_want = x.clone()
        want = OPS.add_rms_norm_(h_want, delta.float(), weight, 1e-6)
        for out_dtype in (torch.bfloat16, torch.float32):
            h = x.clone()
            got = fused.add_rms_norm_bf16_(h, delta, weight, 1e-6, out_dtype)
            assert torch.equal(h, h_want) and torch.equal(got, want.to(out_dtype))
        want_act = OPS.silu_mul(gate_up.float()).bfloat16()
        assert torch.equal(fused.silu_mul_bf16(gate_up), want_act)
        assert torch.equal(OPS.silu_mul_bf16(gate_up), want_act)
    finally:
        torch.set_num_threads(previous)


def _rotary(rope: dict | None = None) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_config("llama")
    if rope is not None:
        config.rope_parameters = {"rope_theta": 10000.0, **rope}
    return LlamaRotaryEmbedding(config)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rope_matches_torch_in_place(fused: FusedElementwise, rows: int) -> None:
    q_heads, kv_heads, head_dim = 4, 2, 16
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
    positions = torch.randint(0, 400, (rows,), generator=torch.Generator().manual_seed(3))
    table = RotaryTable(_rotary()).rows_for(positions)
    got, want = qkv.clone(), qkv.clone()
    fused.rope_(got, table, q_heads, kv_heads)
    TORCH.rope_(want, table, q_heads, kv_heads)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    value_start = (q_heads + kv_heads) * head_dim
    assert torch.equal(got[:, value_start:], qkv[:, value_start:])  # values untouched
    assert not torch.equal(got[:, :value_start], qkv[:, :value_start])


def test_rotary_table_rows_equal_the_module() -> None:
    rotary = _rotary({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})  # fmt: skip
    table = RotaryTable(rotary)
    assert not table.dynamic
    positions = torch.tensor([0, 5, 255, 3, 1000])  # 1000 grows the table past 256
    cos, sin, index = table.rows_for(positions)
    want_cos, want_sin = rotary(torch.empty(1), positions[None])
    assert cos.shape[0] >= 1001
    assert torch.equal(cos[index], want_cos[0]) and torch.equal(sin[index], want_sin[0])


def test_dynamic_rotary_is_computed_per_step() -> None:
    table = RotaryTable(_rotary({"rope_type": "dynamic", "factor": 2.0}))
    assert table.dynamic
    positions = torch.tensor([7, 600])  # beyond max_position_embeddings: rescaled
    cos, _, index = table.rows_for(positions)
    assert cos.shape[0] == 2 and index.tolist() == [0, 1]


@needs_kernels
def test_bad_arguments_name_what_was_expected() -> None:
    assert OPS is not None
    with pytest.raises(ValueError, match="x: expected a float32 CPU tensor"):
        OPS.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="gate_up: expected a contiguous tensor"):
        OPS.silu_mul(torch.ones(8, 4).t())
    with pytest.raises(ValueError, match="delta: expected shape"):
        OPS.add_rms_norm_(torch.ones(2, 4), torch.ones(3, 4), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="delta: expected a bfloat16 CPU tensor"):
        OPS.add_rms_norm_bf16_(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="out_dtype: expected bfloat16 or float32"):
        OPS.add_rms_norm_bf16_(
            torch.ones(2, 4), torch.ones(2, 4).bfloat16(), torch.ones(4), 1e-6, torch.float16
        )
    with pytest.raises(ValueError, match="gate_up: expected a bfloat16 CPU tensor"):
        OPS.silu_mul_bf16(torch.ones(2, 8))
    cos = torch.ones(10, 4)
    with pytest.raises(ValueError, match="positions: beyond the 10 cached"):
        OPS.rope_(torch.ones(1, 12), torch.tensor([10]), cos, cos, 1, 1)


def test_pick_elementwise_falls_back_to_torch_off_float32_cpu() -> None:
    assert isinstance(pick_elementwise(torch.device("cpu"), torch.bfloat16), TorchElementwise)
    expected = TorchElementwise if OPS is None else FusedElementwise
    assert isinstance(pick_elementwise(torch.device("cpu"), torch.float32), expected)


def _save_rope_model(directory: Path, rope: dict) -> Path:
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.rope_parameters = {"rope_theta": 10000.0, **rope}
    torch.manual_seed(3)  # top-2 logit gap >= 0.09 on both prompts with both rope types
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().save_pretrained(directory)
    return directory


ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}  # fmt: skip


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rope_scaled_models_match_transformers(rope: str, tmp_path: Path, hf_greedy) -> None:
    model_dir = _save_rope_model(tmp_path / rope, ROPES[rope])
    prompts = [[(7 * i + 3) % TINY_VOCAB for i in range(n)] for n in (5, 40)]
    llm = LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, [params] * len(prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(model_dir, prompt, 12, min_gap=0.02)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 2048])
def test_rope_bf16_equals_widening_then_the_float32_rope(
    fused: FusedElementwise, rows: int, threads: int
) -> None:
    """The bf16 path's one-pass rope: a bf16 GEMM's qkv widened with q and k rotated gives
    the bits of `.float()` followed by the float32 kernel; the value heads are only widened."""
    assert OPS is not None
    q_heads, kv_heads, head_dim = 9, 3, 64
    width = (q_heads + 2 * kv_heads) * head_dim
    gen = torch.Generator().manual_seed(rows)
    qkv = (3 * torch.randn(rows, width, generator=gen)).bfloat16()
    positions = torch.randint(0, 100, (rows,), generator=gen)
    angles = torch.rand(100, head_dim, generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        want = qkv.float()
        OPS.rope_(want, positions, cos, sin, q_heads, kv_heads)
        got = OPS.rope_bf16(qkv, positions, cos, sin, q_heads, kv_heads)
        assert torch.equal(got, want)
        index = torch.arange(rows)
        table = (cos[positions], sin[positions], index)
        assert torch.equal(fused.rope_bf16(qkv, table, q_heads, kv_heads), want)
        assert not torch.equal(want[:, : q_heads * head_dim], qkv[:, : q_heads * head_dim].float())
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(ValueError, match="qkv: expected a bfloat16 CPU tensor"):
        OPS.rope_bf16(qkv.float(), positions, cos, sin, q_heads, kv_heads)
    with pytest.raises(ValueError, match="positions: beyond the 100 cached"):
        OPS.rope_bf16(qkv, positions + 100, cos, sin, q_heads, kv_heads)
