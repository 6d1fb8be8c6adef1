"""GGUF Q4_K and Q6_K kept quantized: random valid blocks dequantize bit for bit as gguf's
reference does, the kernel multiplies exactly those weights, mixed formats fuse exactly, and
a tiny Llama GGUF in K-quants runs kept quantized with the dequantized model's greedy
tokens (and transformers' on the converted checkpoint)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tandem import LLM, SamplingParams
from tandem.models.panel_linear import panel_gemm_kernel
from tandem.models.quant_linear import QuantLinear
from tandem.models.quantized_weight import (
    GGUF_BLOCKS,
    QuantizedWeight,
    common_format,
    from_gguf_blocks,
    quantize_int8,
)
from tandem.testing.tiny_gguf import gguf_blocks, write_tiny_gguf

KERNEL = panel_gemm_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: the kernel path")
K_TYPES = ("Q4_K", "Q6_K")
#: Byte offsets of each type's fp16 fields (d, dmin / d) in a super-block.
_HALVES = {"Q4_K": (0, 2), "Q6_K": (208,)}
#: A Q4_K_M-like model: Q4_K layers, Q6_K V, down and LM head, Q4_K embedding.
K_MIX = {
    "token_embd": "Q4_K",
    "output": "Q6_K",
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
}


def random_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes for every field, with finite fp16 scales of every magnitude and sign
    (subnormals and zero included): valid blocks gguf dequantizes to finite values."""
    rng = np.random.default_rng(seed)
    _, block_bytes = GGUF_BLOCKS[kind]
    raw = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    for start in _HALVES[kind]:
        exponent = rng.integers(-9, 3, size=raw.shape[:2])
        values = (rng.standard_normal(raw.shape[:2]) * 10.0**exponent).astype(np.float16)
        values[0, 0] = 0.0
        values[-1, -1] = np.float16(6e-8)  # the smallest subnormal
        raw[..., start : start + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _reference(kind: str, data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(data, GGMLQuantizationType[kind]))


@pytest.mark.parametrize("kind", K_TYPES)
def test_random_k_blocks_dequantize_bit_exact(kind: str) -> None:
    data = random_blocks(kind, 24, 768, seed=1)
    kept = from_gguf_blocks(kind, data, (24, 768))
    reference = _reference(kind, data)
    assert torch.isfinite(reference).all()
    assert (kept.bits, kept.group_size) == ((4, 32) if kind == "Q4_K" else (8, 16))
    assert kept.codes.max() <= (15 if kind == "Q4_K" else 63)
    assert torch.equal(kept.dequantize(), reference)
    linear = QuantLinear(kept)
    assert torch.equal(linear.dense_weight(), reference)
    assert torch.equal(linear.rows(torch.tensor([0, 23, 7])), reference[[0, 23, 7]])


@pytest.mark.parametrize("kind", K_TYPES)
def test_k_scales_need_float32_and_are_held_so(kind: str) -> None:
    """`d * sc` is a product of an fp16 and a 6- or 8-bit integer: not an fp16 value in
    general, so the layer keeps float32 scales (fp16 ones would round them)."""
    kept = from_gguf_blocks(kind, random_blocks(kind, 16, 256, seed=2), (16, 256))
    assert not torch.equal(kept.scales.half().float(), kept.scales)
    layer = QuantLinear(kept)
    if KERNEL is not None:
        assert not layer.half_scales and layer.scales is not None
        assert layer.scales.dtype == torch.float32


@needs_kernel
@pytest.mark.parametrize("kind", K_TYPES)
@pytest.mark.parametrize("portable", [False, True])
def test_kernel_uses_exactly_the_k_quant_weights(kind: str, portable: bool) -> None:
    """Identity rows: each output is one weight, so any difference is a wrong weight."""
    data = random_blocks(kind, 40, 512, seed=3)
    linear = QuantLinear(from_gguf_blocks(kind, data, (40, 512)))
    dense = _reference(kind, data)
    for rows in (1, 3, 4, 5, 96, 512):  # the register path and the dequantized-panel path
        eye = torch.eye(512)[:rows]
        assert torch.equal(linear.run(eye, portable), dense.t()[:rows]), (kind, rows)


@pytest.mark.parametrize("kind", K_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 13, 64])
def test_k_quant_layer_matches_dequantize_then_matmul(kind: str, rows: int) -> None:
    """Against x @ W.T + b in float64 over gguf's dequantized W: within 1e-5 of
    sum |x| |w| (float32 accumulation in another order; the weights themselves are exact)."""
    weight = torch.randn(48, 512, generator=torch.Generator().manual_seed(rows)).numpy()
    data = gguf_blocks(kind, weight * 0.05)
    generator = torch.Generator().manual_seed(100 + rows)
    bias = torch.randn(48, generator=generator)
    x = torch.randn(rows, 512, generator=generator)
    linear = QuantLinear(from_gguf_blocks(kind, data, (48, 512)), bias)
    dense = _reference(kind, data).double()
    expected = x.double() @ dense.t() + bias.double()
    bound = 1e-5 * (x.double().abs() @ dense.abs().t() + bias.abs().double()) + 1e-6
    outputs = [linear(x)]
    if KERNEL is not None:
        outputs.append(linear.run(x, portable=True))
    for y in outputs:
        assert ((y.double() - expected).abs() <= bound).all(), (kind, rows)


def test_mixed_formats_fuse_exactly_in_a_common_format() -> None:
    """A Q4_K Q and K with a Q6_K V (and a Q4_1 part): 8-bit codes in groups of 16, every
    weight unchanged; the fused layer multiplies exactly the stacked weights."""
    q4k = from_gguf_blocks("Q4_K", random_blocks("Q4_K", 16, 256, seed=4), (16, 256))
    q6k = from_gguf_blocks("Q6_K", random_blocks("Q6_K", 8, 256, seed=5), (8, 256))
    weight = torch.randn(8, 256).numpy() * 0.05
    q41 = from_gguf_blocks("Q4_1", gguf_quantize(weight, GGMLQuantizationType.Q4_1), (8, 256))
    parts = [q4k, q4k, q6k, q41]
    assert common_format(parts) == (8, 16)
    fused = QuantizedWeight.cat(parts)
    assert (fused.bits, fused.group_size, fused.kind) == (8, 16, "Q4_1+Q4_K+Q6_K")
    stacked = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(fused.dequantize(), stacked)
    if KERNEL is not None:
        assert torch.equal(QuantLinear(fused).run(torch.eye(256)[:3]), stacked.t()[:3])


def test_regroup_never_loses_bits_and_refuses_what_it_cannot_hold() -> None:
    q4k = from_gguf_blocks("Q4_K", random_blocks("Q4_K", 4, 256, seed=6), (4, 256))
    assert torch.equal(q4k.regroup(8, 16).dequantize(), q4k.dequantize())
    q6k = from_gguf_blocks("Q6_K", random_blocks("Q6_K", 4, 256, seed=7), (4, 256))
    with pytest.raises(ValueError, match="cannot be held exactly as 4-bit codes"):
        q6k.regroup(4, 16)
    with pytest.raises(ValueError, match="in groups of 32"):
        q6k.regroup(8, 32)
    narrow = quantize_int8(torch.randn(4, 128))
    assert common_format([narrow, quantize_int8(torch.randn(4, 64))]) is None  # inputs differ


def test_truncated_k_blocks_are_refused_naming_the_sizes() -> None:
    data = random_blocks("Q4_K", 2, 256, seed=8)
    with pytest.raises(ValueError, match="needs rows of whole 256-blocks, got 128"):
        from_gguf_blocks("Q4_K", data, (2, 128))
    with pytest.raises(ValueError, match=r"Q6_K tensor of shape \(2, 256\) needs 420 bytes"):
        from_gguf_blocks("Q6_K", data, (2, 256))


@pytest.mark.parametrize("kind", K_TYPES)
def test_tiny_gguf_k_quantizers_follow_the_weights(kind: str) -> None:
    """The fixture's own K-quantizers write valid blocks: gguf reads them back within one
    grid step of the weights."""
    weight = torch.randn(8, 512, generator=torch.Generator().manual_seed(9)).numpy()
    back = gguf_dequantize(gguf_blocks(kind, weight), GGMLQuantizationType[kind])
    bound = np.abs(weight).max() / (7 if kind == "Q4_K" else 15)
    assert np.abs(back - weight).max() < bound
    assert np.corrcoef(back.ravel(), weight.ravel())[0, 1] > 0.99


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private $TANDEM_CACHE, so a GGUF test never writes into the user's cache."""
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    yield tmp_path / "cache"


def test_k_quant_tensors_are_kept_bit_for_bit(tmp_path: Path, isolated_cache: Path) -> None:
    """Every K-quant tensor of a tiny GGUF, read by name with Q/K rows put back in HF order,
    dequantizes to exactly the converted float32 checkpoint's tensor; a rank's row block is
    the whole tensor's rows; a column split that would cut a group names the tensor."""
    from tandem.models.checkpoint_shards import CheckpointShards
    from tandem.models.gguf_weights import GGUFShards
    from tandem.models.model_files import load_hf_config, resolve_model_dir

    path = write_tiny_gguf(tmp_path / "tiny-k.gguf", K_MIX)
    model_dir = resolve_model_dir(str(path))
    floats = CheckpointShards(model_dir)
    shards = GGUFShards(path, floats, load_hf_config(model_dir), list(floats.files))
    assert shards.kept_types == {"Q4_K": 11, "Q6_K": 5}
    for name in floats.files:
        if shards.is_quantized(name):
            assert torch.equal(shards.quantized(name).dequantize(), floats.rows(name)), name
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        whole = shards.quantized(name).dequantize()
        halves = [shards.rows(name, part, 2).dequantize() for part in (0, 1)]
        assert torch.equal(torch.cat(halves), whole), name
    down = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=rf"{down} \(GGUF Q6_K, groups of 16 inputs\)"):
        shards.cols(down, 0, 3)


def test_types_not_kept_are_dequantized_with_one_log_line(
    tmp_path: Path, isolated_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tandem.models.checkpoint_shards import CheckpointShards
    from tandem.models.gguf_weights import GGUFShards
    from tandem.models.model_files import load_hf_config, resolve_model_dir

    path = write_tiny_gguf(tmp_path / "tiny-q5.gguf", {"attn_q": "Q4_K", "ffn_up": "Q5_0"})
    floats = CheckpointShards(resolve_model_dir(str(path)))
    with caplog.at_level(logging.WARNING, logger="tandem.model"):
        shards = GGUFShards(path, floats, load_hf_config(floats.model_dir), list(floats.files))
    lines = [r.getMessage() for r in caplog.records if "not kept quantized" in r.getMessage()]
    assert len(lines) == 1 and "['Q5_0']" in lines[0] and ": 2 tensors" in lines[0]
    assert shards.kept_types == {"Q4_K": 2}
    assert not shards.is_quantized("model.layers.0.mlp.up_proj.weight")


def test_k_quant_gguf_runs_kept_with_the_dequantized_models_tokens(
    tmp_path: Path, isolated_cache: Path, hf_greedy
) -> None:
    """The tiny Llama in Q4_K / Q6_K: `auto` keeps every layer, the embedding and the LM head
    quantized and gives the greedy tokens of `none` (the converted float32 weights), which
    are transformers' on that checkpoint."""
    from tandem.models.model_files import resolve_model_dir

    path = write_tiny_gguf(tmp_path / "tiny-k.gguf", K_MIX)
    prompts = [[5, 17, 99, 3, 250, 41, 7], list(range(30, 75))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens: dict[str, list[list[int]]] = {}
    for mode in ("auto", "none"):
        llm = LLM(
            model=str(path), quantization=mode, max_model_len=128, num_kv_blocks=64, block_size=4
        )
        try:
            (described,) = llm.engine.executor.collective_rpc("describe")
            expected = "gguf:Q4_K,Q6_K" if mode == "auto" else "none"
            assert described["quantization"] == expected
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[mode] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.engine.shutdown()
    model_dir = resolve_model_dir(str(path))
    assert tokens["auto"] == tokens["none"]
    assert tokens["none"] == [hf_greedy(model_dir, p, 12) for p in prompts]
