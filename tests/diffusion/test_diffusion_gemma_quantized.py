"""Issue 28: DiffusionGemma with `model.quantization` int8 / int4, its MoE experts included.

Tiny random DiffusionGemma checkpoints (`tandem.testing.tiny_diffusion_gemma`, saved and
loaded back, nothing downloads). The reference for every quantized run is a float model
whose quantized weights were replaced by their dequantized values: each weight put through
`LinearQuantization.quantize(...).dequantize()` here, independently of the model's own
quantizing walk (`diffusion_gemma_quant`), and saved as a plain checkpoint. So a weight the
walk forgot, quantized twice or in another format would show as a logit difference.

- (a) every expert (and every layer linear but the router) is held as packed codes with
  no float copy, shared by the encoder and the decoder, in fewer bytes than float;
- (b) the MoE equals `moe_reference` (the float loop) on the dequantized experts; the
  canvas logits equal transformers' on the dequantized checkpoint within `TOL`; the
  engine's diffusion tokens equal the engine's on that checkpoint;
- (c) `LLM(..., quantization="int8")` runs end to end and reports `int8`.

fp32 throughout; `TOL` = 1e-4 max abs difference on logits of order 1-10 (the kernel sums
in another order than `F.linear`), while quantizing moves the logits by far more (checked).
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from tandem import LLM, SamplingParams
from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore
from tandem.core.worker.parallel_state import RankInfo
from tandem.models.diffusion_gemma import DiffusionGemmaModel
from tandem.models.diffusion_gemma_layers import moe_quantized, moe_reference, route
from tandem.models.diffusion_gemma_parallel import shard_layers
from tandem.models.diffusion_gemma_quant import QuantModule, held_bytes, quantize_model
from tandem.models.quant_experts import QuantExperts
from tandem.models.quant_linear import LinearQuantization, QuantLinear
from tandem.schema.config import ConfigError, EngineConfig
from tandem.stack_file import load_config
from tandem.testing.tiny_diffusion_gemma import (
    BLOCK,
    DIFFUSION_GEMMA_CONFIGS,
    PagedContexts,
    reference_logits,
    tiny_diffusion_gemma,
)
from tests.diffusion.gemma_workload import PROMPTS, SEEDS, run

TOL = 1e-4
MODES = {"int8": LinearQuantization("int8", 32), "int4": LinearQuantization("int4", 32)}
SCHEDULE = {"max_denoising_steps": 3, "t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1}
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=sorted(DIFFUSION_GEMMA_CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    text, canvas = DIFFUSION_GEMMA_CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    tiny_diffusion_gemma(text, canvas).save_pretrained(path)
    return path


def _quantized_weights(hf: DiffusionGemmaForBlockDiffusion) -> list[torch.nn.Parameter]:
    """The weights the documented contract quantizes: every text layer linear but the
    router's, the stacked experts, the self-conditioning MLP (the LM head is tied)."""
    decoder = hf.model.decoder
    params = [
        module.weight
        for root in (*decoder.layers, decoder.self_conditioning)
        for name, module in root.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.startswith("router")
    ]
    params += [layer.experts.gate_up_proj for layer in decoder.layers]
    params += [layer.experts.down_proj for layer in decoder.layers]
    assert hf.lm_head.weight is decoder.embed_tokens.weight
    return params


def dequantized_checkpoint(source: Path, quant: LinearQuantization, target: Path) -> Path:
    """`source` with each quantized weight replaced by `quant`'s dequantized values (stacked
    experts one expert at a time), saved as a float checkpoint (the encoder shares them)."""
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(source)).eval()
    with torch.no_grad():
        for weight in _quantized_weights(hf):
            rows = weight if weight.dim() == 3 else weight[None]
            values = torch.stack([quant.quantize(w).dequantize() for w in rows])
            weight.copy_(values.view(weight.shape))
    hf.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def dequantized(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """mode -> the float checkpoint of `checkpoint`'s weights dequantized in that mode."""
    return {
        mode: dequantized_checkpoint(checkpoint, quant, tmp_path_factory.mktemp(f"deq-{mode}"))
        for mode, quant in MODES.items()
    }


def _text(model: DiffusionGemmaModel) -> list[torch.nn.Module]:
    """The text model's modules (the vision tower is loaded, never run, never quantized)."""
    return [model.hf.model.encoder.language_model, model.hf.model.decoder]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_expert_is_held_quantized_in_fewer_bytes(checkpoint: Path, mode: str) -> None:
    quant = MODES[mode]
    model = DiffusionGemmaModel(checkpoint, torch.float32, 8, BLOCK, CPU, quant)
    float_model = DiffusionGemmaModel(checkpoint, torch.float32, 8, BLOCK, CPU)
    text = model.text_config
    assert model.quantization == mode
    bits = 8 if mode == "int8" else 4
    for enc, dec in zip(model.encoder.layers, model.decoder.layers, strict=True):
        experts = dec.experts
        assert isinstance(experts, QuantExperts) and enc.experts is experts  # tied, once
        assert experts.num_experts == text.num_experts
        for linear in (*experts.gate_up, *experts.down):
            assert isinstance(linear, QuantLinear) and linear.weight is None  # no float copy
            assert linear.codes is not None and linear.codes.dtype == torch.int32  # packed
            assert (linear.bits, linear.kind) == (bits, f"{mode}-g32")
        assert {tuple(lin.dense_weight().shape) for lin in experts.gate_up} == {
            (2 * text.moe_intermediate_size, text.hidden_size)
        }
        attn = dec.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.o_proj, dec.mlp.down_proj):
            assert isinstance(proj, QuantModule) and proj.linear.bits == bits
        assert attn.q_proj is enc.self_attn.q_proj
        router = dec.router.proj  # float, as the docs say
        assert isinstance(router, torch.nn.Linear) and router.weight.dtype == torch.float32
        float_experts = float_model.decoder.layers[0].experts
        float_bytes = sum(
            t.numel() * 4 for t in (float_experts.gate_up_proj, float_experts.down_proj)
        )
        assert experts.nbytes < (0.4 if mode == "int8" else 0.3) * float_bytes
    assert isinstance(model.decoder.self_conditioning.gate_proj, QuantModule)
    assert held_bytes(_text(model)) < 0.5 * held_bytes(_text(float_model))


def test_the_float_weights_replaced_are_freed() -> None:
    """No reference to a quantized float tensor survives `quantize_model` (tied encoder and
    decoder copies included); the router's float weight is kept."""
    hf = tiny_diffusion_gemma(*DIFFUSION_GEMMA_CONFIGS["window"])
    decoder = hf.model.decoder
    layer = decoder.layers[0]
    replaced = [layer.experts.gate_up_proj, layer.experts.down_proj, layer.self_attn.q_proj.weight]
    replaced.append(decoder.self_conditioning.up_proj.weight)
    gone = [weakref.ref(t) for t in replaced]
    kept = weakref.ref(layer.router.proj.weight)
    del replaced, layer
    layers = [hf.model.encoder.language_model.layers, decoder.layers]
    quantize_model(hf, layers, MODES["int8"])
    gc.collect()
    assert [ref() is None for ref in gone] == [True] * len(gone)
    assert kept() is not None


@pytest.mark.parametrize("mode", sorted(MODES))
def test_quantized_moe_equals_the_float_loop_on_dequantized_experts(
    checkpoint: Path, mode: str
) -> None:
    """The experts hold exactly `quantize(w).dequantize()`; the grouped quantized MoE equals
    `moe_reference` over those float weights, on all experts and on an expert-parallel
    half (`first_expert`)."""
    quant = MODES[mode]
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(checkpoint)).eval()
    layer = hf.model.decoder.layers[0]
    source = layer.experts
    model = DiffusionGemmaModel(checkpoint, torch.float32, 8, BLOCK, CPU, quant)
    experts = model.decoder.layers[0].experts
    gate_up, down = experts.dense()
    for e in range(experts.num_experts):
        assert torch.equal(gate_up[e], quant.quantize(source.gate_up_proj[e]).dequantize())
        assert torch.equal(down[e], quant.quantize(source.down_proj[e]).dequantize())
    reference = torch.nn.Module()
    reference.gate_up_proj, reference.down_proj, reference.act_fn = gate_up, down, source.act_fn
    gen = torch.Generator().manual_seed(3)
    hidden = 3 * torch.randn(37, hf.config.text_config.hidden_size, generator=gen)
    with torch.inference_mode():
        weights, index = route(layer.router, hidden)
        got = moe_quantized(experts, hidden, weights, index)
        want = moe_reference(reference, hidden, weights, index)
        assert got.abs().max() > 1.0  # not a trivially small output
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        half = experts.num_experts // 2  # this rank: the experts from `half` on
        local = QuantExperts(experts.gate_up[half:], experts.down[half:], experts.act_fn)
        ref_local = torch.nn.Module()
        ref_local.gate_up_proj, ref_local.down_proj = gate_up[half:], down[half:]
        ref_local.act_fn = source.act_fn
        got = moe_quantized(local, hidden, weights, index, first_expert=half)
        want = moe_reference(ref_local, hidden, weights, index, first_expert=half)
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


class QuantizedContexts(PagedContexts):
    """`PagedContexts` over a model quantized at load."""

    def __init__(self, path: Path, quant: LinearQuantization, num_blocks: int = 96) -> None:
        self.model = DiffusionGemmaModel(path, torch.float32, num_blocks, BLOCK, CPU, quant)
        for k, v in self.model.kv.per_layer:  # unwritten slots must never reach a logit
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}


def _workload(vocab: int, length: int) -> list[tuple[list[int], list[list[int]]]]:
    """(prompt, committed canvases) per request."""
    gen = torch.Generator().manual_seed(5)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    return [(ids(p), [ids(length) for _ in range(k)]) for p, k in [(7, 0), (11, 1), (2, 2)]]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_quantized_logits_equal_transformers_on_the_dequantized_checkpoint(
    checkpoint: Path, dequantized: dict[str, Path], mode: str
) -> None:
    paged = QuantizedContexts(checkpoint, MODES[mode])
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(str(dequantized[mode])).eval()
    original = DiffusionGemmaForBlockDiffusion.from_pretrained(str(checkpoint)).eval()
    vocab, length = paged.model.vocab_size, paged.model.canvas_length
    work = _workload(vocab, length)
    reqs = [f"q{r}" for r in range(len(work))]
    for req, (prompt, canvases) in zip(reqs, work, strict=True):
        paged.encode([(req, prompt)])
        for canvas in canvases:
            paged.encode([(req, canvas)])
    gen = torch.Generator().manual_seed(9)
    canvas = torch.randint(0, vocab, (len(reqs), length), generator=gen)
    sc = 2.0 * torch.randn(len(reqs), length, vocab, generator=gen)
    has = [r % 2 == 1 for r in range(len(reqs))]
    got = paged.denoise(reqs, canvas, sc, has)
    worst, moved = 0.0, 0.0
    with torch.inference_mode():
        for r, (prompt, canvases) in enumerate(work):
            cond = sc[r] if has[r] else None
            want = reference_logits(reference, prompt, canvases, canvas[r], cond)
            worst = max(worst, (got[r] - want).abs().max().item())
            plain = reference_logits(original, prompt, canvases, canvas[r], cond)
            moved = max(moved, (got[r] - plain).abs().max().item())
    assert worst <= TOL, worst
    assert moved > 100 * TOL, moved  # quantizing changed the logits: the test can see it


def engine(path: Path, **overrides: Any) -> EngineCore:
    base = EngineConfig.model_validate({"diffusion": SCHEDULE})
    settings = {"model": str(path), "device": "cpu", "block_size": 4, "max_model_len": 64}
    return EngineCore(resolve_config(load_config(base, **{**settings, **overrides})))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_engine_tokens_equal_the_float_engine_on_dequantized_weights(
    checkpoint: Path, dequantized: dict[str, Path], mode: str
) -> None:
    length = DiffusionGemmaForBlockDiffusion.config_class.from_pretrained(
        str(checkpoint)
    ).canvas_length
    max_tokens = length + length // 2  # two canvases, the second trimmed
    got = run(engine(checkpoint, quantization=mode), max_tokens)
    want = run(engine(dequantized[mode], quantization="none"), max_tokens)
    assert all(len(got[f"r{i}"]) == max_tokens for i in range(len(PROMPTS)))
    assert got == want


def test_llm_runs_the_quantized_diffusion_model_end_to_end(
    checkpoint: Path, dequantized: dict[str, Path]
) -> None:
    max_tokens = 6
    want = run(engine(dequantized["int8"], quantization="none"), max_tokens)["r0"]
    llm = LLM(
        model=str(checkpoint),
        device="cpu",
        block_size=4,
        max_model_len=64,
        diffusion=SCHEDULE,
        quantization="int8",
    )
    try:
        described = llm.engine.executor.collective_rpc("describe")
        assert [d["quantization"] for d in described] == ["int8"]
        params = SamplingParams(max_tokens=max_tokens, seed=SEEDS[0], ignore_eos=True)
        out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length"
        assert list(out.token_ids) == want
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"quantization": "awq"}, r"^model.quantization: awq reads AWQ / GPTQ checkpoints"),
        (
            {"quantization": "int4", "quantization_group_size": 0},
            r"^model.quantization_group_size: int4 needs groups",
        ),
    ],
)
def test_quantization_modes_this_model_cannot_run_name_the_field(
    checkpoint: Path, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_config(load_config(EngineConfig(), model=str(checkpoint), device="cpu", **settings))


#: `window` with every row-parallel input (attention heads x head_dim, the MLP's
#: intermediate size) 64 wide: each of 2 ranks' column blocks holds whole groups of 32.
ALIGNED = {
    **DIFFUSION_GEMMA_CONFIGS["window"][0],
    "intermediate_size": 64,
    "head_dim": 16,
    "global_head_dim": 16,
}


def test_each_rank_quantizes_its_shard_to_one_ranks_codes() -> None:
    """Under tensor parallelism a rank quantizes its own cut of the float weights: its
    experts are one rank's experts `2r, 2r + 1` exactly, and its row-parallel `o_proj` /
    `down_proj` one rank's columns (groups do not straddle the cut here)."""
    quant = MODES["int8"]
    canvas = DIFFUSION_GEMMA_CONFIGS["window"][1]
    whole = tiny_diffusion_gemma(ALIGNED, canvas)
    decoder = whole.model.decoder
    quantize_model(whole, [whole.model.encoder.language_model.layers, decoder.layers], quant)
    for r in range(2):
        part = tiny_diffusion_gemma(ALIGNED, canvas)
        layers = [part.model.encoder.language_model.layers, part.model.decoder.layers]
        shard_layers(part.config.text_config, layers, RankInfo(r, 2, 2))
        quantize_model(part, layers, quant)
        for mine, one in zip(part.model.decoder.layers, decoder.layers, strict=True):
            for got, want in zip(mine.experts.dense(), one.experts.dense(), strict=True):
                assert torch.equal(got, want[2 * r : 2 * r + 2])
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                got = mine.get_submodule(name).linear.dense_weight()
                want = one.get_submodule(name).linear.dense_weight()
                assert torch.equal(got, want[:, 32 * r : 32 * (r + 1)])


def test_two_ranks_commit_one_quantized_ranks_tokens(tmp_path: Path) -> None:
    canvas = DIFFUSION_GEMMA_CONFIGS["window"][1]
    tiny_diffusion_gemma(ALIGNED, canvas).save_pretrained(tmp_path)
    base = dict(device="cpu", block_size=4, max_model_len=64, diffusion=SCHEDULE)
    params = [SamplingParams(max_tokens=10, seed=s, ignore_eos=True) for s in SEEDS]
    engines = []
    try:
        tokens = []
        for tp in (1, 2):
            llm = LLM(model=str(tmp_path), quantization="int8", tensor_parallel_size=tp, **base)
            engines.append(llm)
            described = llm.engine.executor.collective_rpc("describe")
            assert [d["quantization"] for d in described] == ["int8"] * tp
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            tokens.append([list(o.outputs[0].token_ids) for o in outs])
        assert [len(t) for t in tokens[0]] == [10] * len(PROMPTS)
        assert tokens[1] == tokens[0]
    finally:
        for llm in engines:
            llm.shutdown()
