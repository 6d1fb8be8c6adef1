"""AWQ and GPTQ int4 checkpoints, kept quantized on the CPU.

Checkpoints are written here by a reference packer that spells each format out one code at
a time (plain Python loops over known codes, zeros and float16 scales), then loaded by the
engine. Checked: the engine's layers hold exactly the reference dequantization
`scale * (q - zero)`; greedy tokens equal transformers' `generate()` on those dequantized
float weights; unsupported variants are refused naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tandem import LLM, SamplingParams
from tandem.models.awq_gptq_weights import awq_weight, gptq_weight, prequantized_format
from tandem.schema.config import ConfigError
from tandem.testing.tiny_model import save_tiny_model

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble j of a word holds output 8c + AWQ_ORDER[j]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# The reference packer: one code at a time --------------------------------------------------
def _word(nibbles: list[int]) -> int:
    """Eight 4-bit values, nibble j in bits 4j..4j+3, as a signed int32 value."""
    word = 0
    for j, value in enumerate(nibbles):
        assert 0 <= value <= 15
        word |= value << (4 * j)
    return word - (1 << 32) if word >= 1 << 31 else word


def pack_awq(codes: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [in, out], zeros [groups, out] -> qweight [in, out/8], qzeros [groups, out/8]:
    8 outputs per word, output 8c + AWQ_ORDER[j] in nibble j."""

    def pack(values: torch.Tensor) -> torch.Tensor:
        rows, cols = values.shape
        words = [
            [
                _word([int(values[r, 8 * c + AWQ_ORDER[j]]) for j in range(8)])
                for c in range(cols // 8)
            ]
            for r in range(rows)
        ]
        return torch.tensor(words, dtype=torch.int32)

    return pack(codes), pack(zeros)


def pack_gptq(
    codes: torch.Tensor, zeros: torch.Tensor, v1: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [in, out] -> qweight [in/8, out] (8 consecutive inputs per word, input 8r + j in
    nibble j); zeros [groups, out] -> qzeros [groups, out/8] (8 consecutive outputs per
    word), stored as zero - 1 for a v1 checkpoint."""
    inn, out = codes.shape
    qweight = [
        [_word([int(codes[8 * r + j, o]) for j in range(8)]) for o in range(out)]
        for r in range(inn // 8)
    ]
    stored = zeros - 1 if v1 else zeros
    qzeros = [
        [_word([int(stored[g, 8 * c + j]) for j in range(8)]) for c in range(out // 8)]
        for g in range(zeros.shape[0])
    ]
    return torch.tensor(qweight, dtype=torch.int32), torch.tensor(qzeros, dtype=torch.int32)


def reference_dequant(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int
) -> torch.Tensor:
    """w[o, i] = scale[g, o] * (q[i, o] - zero[g, o]), g = i // group, in float64 (exact),
    as float32 `[out, in]`."""
    g = torch.arange(codes.shape[0]) // group
    values = scales.double()[g] * (codes.double() - zeros.double()[g])
    assert torch.equal(values.float().double(), values)  # the format's values fit float32
    return values.float().t().contiguous()


def random_codes(
    inn: int, out: int, group: int, zero_range: tuple[int, int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [in, out] 0..15, zeros [groups, out] in zero_range, float16 scales [groups,
    out]: normal, subnormal and negative ones)."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-inn // group)
    codes = torch.randint(0, 16, (inn, out), generator=gen)
    zeros = torch.randint(zero_range[0], zero_range[1] + 1, (groups, out), generator=gen)
    scales = (torch.rand(groups, out, generator=gen) * 0.02 + 1e-3).half()
    scales[0, :4] = torch.tensor([6e-8, 3e-5, -0.0123, 1.0009765625]).half()  # edge values
    return codes, zeros, scales


def quantize_for(
    weight: torch.Tensor, group: int, zero_range: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float `[out, in]` weight as (codes [in, out], zeros, float16 scales), min/max per
    group of `group` inputs, each zero clamped to `zero_range`."""
    w = weight.detach().double().t()  # [in, out]
    inn = w.shape[0]
    rows = [w[s : s + group] for s in range(0, inn, group)]
    lo = torch.stack([r.amin(0) for r in rows]).clamp(max=0)
    hi = torch.stack([r.amax(0) for r in rows]).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-4).half()
    zeros = torch.round(-lo / scales.double()).clamp(*zero_range).long()
    g = torch.arange(inn) // group
    codes = torch.round(w / scales.double()[g]) + zeros[g]
    return codes.clamp(0, 15).long(), zeros, scales


# Unit checks of the unpacking against the reference -------------------------------------
@pytest.mark.parametrize("group", [32, 64, -1])
def test_awq_words_unpack_to_the_reference_dequantization(group: int) -> None:
    inn, out = 128, 48
    size = inn if group == -1 else group
    codes, zeros, scales = random_codes(inn, out, size, (0, 15), seed=1)
    qweight, qzeros = pack_awq(codes, zeros)
    weight = awq_weight(qweight, qzeros, scales, group, "w")
    assert weight.bits == 4 and weight.shape == (out, inn) and weight.group_size == size
    assert torch.equal(weight.codes, codes.t().to(torch.uint8))
    assert torch.equal(weight.dequantize(), reference_dequant(codes, zeros, scales, size))


@pytest.mark.parametrize(("v1", "group"), [(True, 32), (False, 64), (True, -1)])
def test_gptq_words_unpack_to_the_reference_dequantization(v1: bool, group: int) -> None:
    inn, out = 128, 40
    size = inn if group == -1 else group
    zero_range = (1, 16) if v1 else (0, 15)  # v1 stores zero - 1 in a nibble
    codes, zeros, scales = random_codes(inn, out, size, zero_range, seed=2)
    qweight, qzeros = pack_gptq(codes, zeros, v1)
    g_idx = (torch.arange(inn) // size).to(torch.int32)
    weight = gptq_weight(qweight, qzeros, scales, g_idx, group, 1 if v1 else 0, "w")
    assert torch.equal(weight.codes, codes.t().to(torch.uint8))
    assert torch.equal(weight.dequantize(), reference_dequant(codes, zeros, scales, size))


def test_symmetric_gptq_keeps_float16_scales_and_mins() -> None:
    """Zero 8 everywhere (stored as 7 in v1): min = -8 * scale is a float16 value, so the
    layer holds 2-byte scales and mins; an asymmetric layer holds float32 mins."""
    from tandem.models.quant_linear import QuantLinear

    codes, _, scales = random_codes(64, 16, 32, (8, 8), seed=5)
    scales = scales.abs()
    zeros = torch.full((2, 16), 8)
    qweight, qzeros = pack_gptq(codes, zeros, v1=True)
    assert int(qzeros[0, 0]) == 0x77777777
    weight = gptq_weight(qweight, qzeros, scales, None, 32, 1, "w")
    assert torch.equal(weight.dequantize(), reference_dequant(codes, zeros, scales, 32))
    assert QuantLinear(weight).half_scales
    codes, zeros, scales = random_codes(64, 16, 32, (1, 15), seed=6)
    qweight, qzeros = pack_gptq(codes, zeros, v1=True)
    assert not QuantLinear(gptq_weight(qweight, qzeros, scales, None, 32, 1, "w")).half_scales


def test_gptq_act_order_g_idx_is_refused_naming_desc_act() -> None:
    codes, zeros, scales = random_codes(64, 16, 32, (1, 15), seed=3)
    qweight, qzeros = pack_gptq(codes, zeros, True)
    g_idx = (torch.randperm(64, generator=torch.Generator().manual_seed(0)) // 32).int()
    with pytest.raises(ValueError, match=r"layer\.g_idx: quantization_config\.desc_act"):
        gptq_weight(qweight, qzeros, scales, g_idx, 32, 1, "layer")


def test_mismatched_tensor_shapes_are_refused_naming_the_tensor() -> None:
    codes, zeros, scales = random_codes(64, 16, 32, (0, 15), seed=4)
    qweight, qzeros = pack_awq(codes, zeros)
    with pytest.raises(ValueError, match=r"proj\.scales: expected shape \[2, 16\]"):
        awq_weight(qweight, qzeros, scales[:1], 32, "proj")


# Whole checkpoints through the engine ----------------------------------------------------
def write_checkpoint(
    float_dir: Path, target: Path, method: str, group: int, v1: bool = True, biases: bool = False
) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny model at `float_dir` as an AWQ / GPTQ checkpoint in `target` (quantized
    linears packed by the reference packer, every other tensor float16, as those
    checkpoints hold them). Returns (target, name -> reference dequantized weight)."""
    from safetensors.torch import load_file

    floats = load_file(str(float_dir / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in floats.items():
        base = name.removesuffix(".weight")
        if base.split(".")[-1] not in LINEARS:
            tensors[name] = tensor.half()
            continue
        size = tensor.shape[1] if group == -1 else group
        zero_range = (1, 15) if method == "gptq" and v1 else (0, 15)
        codes, zeros, scales = quantize_for(tensor, size, zero_range)
        dense[name] = reference_dequant(codes, zeros, scales, size)
        if method == "awq":
            qweight, qzeros = pack_awq(codes, zeros)
        else:
            qweight, qzeros = pack_gptq(codes, zeros, v1)
            tensors[f"{base}.g_idx"] = (torch.arange(tensor.shape[1]) // size).to(torch.int32)
            if biases:  # AutoGPTQ saved a zero bias for every linear
                tensors[f"{base}.bias"] = torch.zeros(tensor.shape[0], dtype=torch.float16)
        tensors |= {f"{base}.qweight": qweight, f"{base}.qzeros": qzeros, f"{base}.scales": scales}
    target.mkdir(parents=True)
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    if method == "awq":
        quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True}
        quant["version"] = "gemm"
    else:
        quant = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False}
        quant |= {"sym": False, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    config |= {"quantization_config": quant, "torch_dtype": "float16", "dtype": "float16"}
    (target / "config.json").write_text(json.dumps(config))
    return target, dense


def reference_model(float_dir: Path, dense: dict[str, torch.Tensor], target: Path) -> Path:
    """The float32 model transformers runs: the dequantized linears, every other tensor
    rounded through float16 (what the quantized checkpoint holds)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(dense[name] if name in dense else param.half().float())
    model.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("float") / "llama")


CASES = [
    pytest.param("awq", 32, True, False, id="awq-g32"),
    pytest.param("awq", 64, True, False, id="awq-g64"),
    pytest.param("gptq", 32, True, True, id="gptq-v1-g32-zero-biases"),
    pytest.param("gptq", -1, False, False, id="gptq-v2-one-group"),
]


@pytest.mark.parametrize(("method", "group", "v1", "biases"), CASES)
def test_engine_holds_the_reference_weights_and_matches_transformers(
    method: str,
    group: int,
    v1: bool,
    biases: bool,
    llama_dir: Path,
    hf_greedy: Any,
    tmp_path: Path,
) -> None:
    quantized, dense = write_checkpoint(llama_dir, tmp_path / "q", method, group, v1, biases)
    reference = reference_model(llama_dir, dense, tmp_path / "ref")
    llm = LLM(model=str(quantized), max_model_len=128, num_kv_blocks=64, block_size=4)
    try:
        model = llm.engine.executor.worker.model
        label = "gall" if group == -1 else f"g{group}"
        assert model.quantization == f"{method}-int4-{label}"
        for i, layer in enumerate(model.fused.layers):
            prefix = f"model.layers.{i}."

            def ref(*names: str, p: str = prefix) -> torch.Tensor:
                return torch.cat([dense[f"{p}{n}.weight"] for n in names])

            expected = {
                "qkv": ref("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "o": ref("self_attn.o_proj"),
                "gate_up": ref("mlp.gate_proj", "mlp.up_proj"),
                "down": ref("mlp.down_proj"),
            }
            for attr, weight in expected.items():
                linear = getattr(layer, attr)
                assert linear.kind.startswith(method), (attr, linear.kind)
                assert torch.equal(linear.dense_weight(), weight), (i, attr)
        prompts = [[5, 17, 99, 3, 250, 41, 7], list(range(30, 75))]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            assert list(out.outputs[0].token_ids) == hf_greedy(reference, prompt, 12)
    finally:
        llm.engine.shutdown()


def test_quantization_none_dequantizes_to_the_same_weights(llama_dir: Path, tmp_path: Path) -> None:
    quantized, dense = write_checkpoint(llama_dir, tmp_path / "q", "awq", 32)
    llm = LLM(
        model=str(quantized), quantization="none", max_model_len=64, num_kv_blocks=32, block_size=4
    )
    try:
        model = llm.engine.executor.worker.model
        assert model.quantization == "none (dequantized awq-int4-g32)"
        down = model.fused.layers[1].down
        assert not hasattr(down, "kind")  # a float linear
        assert torch.equal(down.dense_weight(), dense["model.layers.1.mlp.down_proj.weight"])
    finally:
        llm.engine.shutdown()


# Refusals -----------------------------------------------------------------------------------
class _Config:
    def __init__(self, quantization_config: dict[str, Any]) -> None:
        self.quantization_config = quantization_config


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (AWQ | {"bits": 8}, r"quantization_config\.bits: tandem loads 4-bit AWQ .* got 8"),
        (GPTQ | {"bits": 3}, r"quantization_config\.bits: tandem loads 4-bit GPTQ .* got 3"),
        (AWQ | {"version": "gemv"}, r"quantization_config\.version: .*gemm.*'gemv'"),
        (AWQ | {"zero_point": False}, r"quantization_config\.zero_point"),
        (AWQ | {"backend": "llm-awq"}, r"quantization_config\.backend"),
        (GPTQ | {"checkpoint_format": "marlin"}, r"quantization_config\.checkpoint_format"),
        (GPTQ | {"lm_head": True}, r"quantization_config\.lm_head"),
        (GPTQ | {"group_size": 100}, r"quantization_config\.group_size: .*got 100"),
        ({"quant_method": "bitsandbytes"}, r"quantization_config\.quant_method: .*'bitsandbytes'"),
    ],
)
def test_unsupported_variants_are_refused_naming_the_field(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        prequantized_format(_Config(config))


def test_supported_variants_parse() -> None:
    assert prequantized_format(_Config(AWQ)).label == "awq-int4-g128"
    v1 = prequantized_format(_Config(GPTQ | {"desc_act": True}))
    assert (v1.method, v1.zero_offset) == ("gptq", 1)  # desc_act: decided by g_idx at load
    assert prequantized_format(_Config(GPTQ | {"checkpoint_format": "gptq_v2"})).zero_offset == 0
    assert prequantized_format(_Config(GPTQ | {"group_size": -1})).label == "gptq-int4-gall"
    assert prequantized_format(object()) is None


def _resolve(model: Path, **overrides: Any) -> Any:
    from tandem.config_resolution import resolve_config
    from tandem.stack_file import load_config

    return resolve_config(load_config(None, model=str(model), **overrides))


def test_engine_refuses_a_bad_config_and_a_conflicting_quantization(
    llama_dir: Path, tmp_path: Path
) -> None:
    quantized, _ = write_checkpoint(llama_dir, tmp_path / "q", "awq", 32)
    assert _resolve(quantized).model.quantization == "auto"
    assert _resolve(quantized, quantization="awq").model.quantization == "awq"
    for mode in ("int8", "int4", "gptq"):
        with pytest.raises(
            ConfigError,
            match=rf"model\.quantization: {mode} conflicts with .*"
            r"quantization_config\.quant_method: awq",
        ):
            _resolve(quantized, quantization=mode)
    with pytest.raises(ConfigError, match=r"model\.quantization: awq needs a checkpoint"):
        _resolve(llama_dir, quantization="awq")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"]["version"] = "exllama"
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"quantization_config\.version"):
        LLM(model=str(quantized), max_model_len=64, num_kv_blocks=32, block_size=4)


def test_engine_refuses_act_order_groups_naming_desc_act(llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    quantized, _ = write_checkpoint(llama_dir, tmp_path / "q", "gptq", 32)
    tensors = load_file(str(quantized / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # groups in descending order
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj\.g_idx: quantization_config\.desc_act"):
        LLM(model=str(quantized), max_model_len=64, num_kv_blocks=32, block_size=4)


def test_two_tensor_parallel_ranks_give_one_ranks_tokens(llama_dir: Path, tmp_path: Path) -> None:
    """Each rank keeps its rows of Q/K/V and gate/up and whole groups of O's and down's
    columns, cut from the packed tensors."""
    quantized, _ = write_checkpoint(llama_dir, tmp_path / "q", "gptq", 32, v1=True)
    settings = dict(max_model_len=64, num_kv_blocks=32, block_size=4)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 61))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = []
    for ranks in (1, 2):
        llm = LLM(model=str(quantized), tensor_parallel_size=ranks, **settings)
        try:
            described = llm.engine.executor.collective_rpc("describe")
            assert [d["quantization"] for d in described] == ["gptq-int4-g32"] * ranks
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens.append([list(o.outputs[0].token_ids) for o in outs])
        finally:
            llm.engine.shutdown()
    assert tokens[1] == tokens[0]


def test_accuracy_of_a_kept_awq_checkpoint_against_its_dequantized_weights(
    llama_dir: Path, tmp_path: Path
) -> None:
    """`tandem bench --accuracy`'s measurement: `auto` (int4 layers kept) against `none`
    (the same weights dequantized) differs only by float summation order."""
    from tandem.accuracy import measure_accuracy
    from tandem.testing.tiny_model import WORDS, save_tiny_tokenizer

    quantized, _ = write_checkpoint(llama_dir, tmp_path / "q", "awq", 32)
    save_tiny_tokenizer(quantized)
    text = tmp_path / "words.txt"
    text.write_text(" ".join(WORDS[i % len(WORDS)] + f" w{20 + i}" for i in range(60)))
    report = measure_accuracy(str(quantized), ["none", "auto"], text, 40, {"worker_num_threads": 1})
    none, auto = report["results"]["none"], report["results"]["auto"]
    assert none["quantization"] == "none (dequantized awq-int4-g32)"
    assert auto["quantization"] == "awq-int4-g32" and auto["positions"] == 117
    assert auto["top1_agreement"] == 1.0
    assert abs(auto["perplexity_ratio"] - 1) < 1e-4
    with pytest.raises(ConfigError, match=r"int8 conflicts with .*quant_method: awq"):
        measure_accuracy(str(quantized), ["int8"], text, 40, {"worker_num_threads": 1})
