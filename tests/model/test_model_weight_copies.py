"""One copy of each weight in a loaded step model (issue 16 item 6) with the one-copy
layout (`model.f32_linear: panel`), outputs unchanged.

After `HFStepModel` is built (fused decoder, LM head), the distinct storages reachable from
it add up to at most 1.05x the checkpoint's parameters (tied weights once; a tied LM head
may keep its packed copy beside the embedding's lookup table), the HF layers' parameters
are released (meta), no kept tensor views the checkpoint's file mapping (which would keep
every page of it resident), and greedy outputs still equal transformers' `generate()`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tandem.llm import LLM
from tandem.models.hf_model import HFStepModel
from tandem.models.packed_linear import onednn_usable
from tandem.schema.sampling_params import SamplingParams
from tandem.testing.tiny_model import TINY_ARCHS, TINY_SEEDS, TINY_VOCAB, tiny_config
from tandem.testing.weight_storage import (
    parameter_bytes,
    reachable_storages,
    reachable_weight_bytes,
)

ARCHS = [pytest.param(a, id=a) for a in TINY_ARCHS]
#: Allowed slack over the parameter bytes (oneDNN's blocked layout may pad; norms copied).
SLACK = 1.05


@pytest.fixture(autouse=True)
def one_copy_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-copy layout (`model.f32_linear: panel`); `dual`, auto's choice on AVX-512
    CPUs, keeps a second oneDNN copy of each layer weight on purpose."""
    monkeypatch.setenv("TANDEM_F32_LINEAR", "panel")


def _step_model(model_dir: Path) -> HFStepModel:
    return HFStepModel(
        model_dir=model_dir,
        dtype=torch.float32,
        num_blocks=32,
        block_size=4,
        device=torch.device("cpu"),
    )


def _file_ranges(model_dir: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `model_dir`'s safetensors files."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith(str(model_dir)):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its LM head tied to the embedding (as SmolLM2's is)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.tie_word_embeddings = True
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(TINY_SEEDS["llama"])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    finally:
        torch.random.set_rng_state(state)
    target = tmp_path_factory.mktemp("tied") / "llama"
    model.save_pretrained(target)
    return target


@pytest.mark.parametrize("arch", ARCHS)
def test_untied_model_holds_one_copy(arch: str, tiny_models, hf_reference) -> None:
    model_dir = tiny_models[arch]
    reference = hf_reference.model(model_dir)
    step = _step_model(model_dir)
    held, params = reachable_weight_bytes(step), parameter_bytes(reference)
    assert held <= SLACK * params, f"{held} bytes held for {params} bytes of parameters"
    for layer in step.model.model.layers:
        assert all(p.is_meta for p in layer.parameters()), "the HF layers keep their weights"
    assert not step.model.model.embed_tokens.weight.is_meta
    if onednn_usable(reference.lm_head.weight):
        linears = [step.lm_head] + [
            lin for layer in step.fused.layers for lin in (layer.qkv, layer.o, layer.gate_up)
        ]
        assert all(lin.weight is None and lin.packed is not None for lin in linears)
        assert step.model.lm_head.weight.is_meta
    # Rows of the LM head (the EAGLE drafter's reduced vocabulary) come back exactly.
    assert torch.equal(step.lm_head.dense_weight(), reference.lm_head.weight.detach())


@pytest.mark.parametrize("arch", ARCHS)
def test_no_kept_tensor_views_the_checkpoint_file(arch: str, tiny_models) -> None:
    model_dir = tiny_models[arch]
    step = _step_model(model_dir)
    ranges = _file_ranges(model_dir)
    for kind, ptr in reachable_storages(step):
        if kind == "plain":
            assert not any(lo <= ptr < hi for lo, hi in ranges), "a tensor views the file"


def test_tied_head_shares_the_embedding(tied_llama: Path, hf_reference) -> None:
    reference = hf_reference.model(tied_llama)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    step = _step_model(tied_llama)
    embed = step.model.model.embed_tokens.weight
    assert step.model.lm_head.weight is embed and not embed.is_meta
    head = step.lm_head
    extra = head.out_features * head.in_features * 4 if head.packed is not None else 0
    held = reachable_weight_bytes(step)
    assert held <= SLACK * (parameter_bytes(reference) + extra)


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", [*ARCHS, pytest.param("tied", id="tied-llama")])
def test_outputs_equal_transformers(arch: str, tiny_models, tied_llama: Path, hf_greedy) -> None:
    """Batch 1 (the one-row linears) and a batch of 4 (more rows), greedy, vs generate()."""
    model_dir = tied_llama if arch == "tied" else tiny_models[arch]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(5 + 6 * i)] for i in range(4)]
    llm = LLM(
        model=str(model_dir),
        max_model_len=64,
        num_kv_blocks=96,
        block_size=4,
        async_scheduling=False,
        enable_prefix_caching=False,
    )
    try:
        single = _greedy(llm, prompts[:1], 12)
        batch = _greedy(llm, prompts, 12)
    finally:
        llm.engine.shutdown()
    expected = [hf_greedy(model_dir, p, 12, min_gap=1e-4) for p in prompts]
    assert single == expected[:1]
    assert batch == expected


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with `attention_bias` and `mlp_bias`: every projection has a bias."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.attention_bias = True
    config.mlp_bias = True
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(TINY_SEEDS["llama"])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():  # biases start at zero: make them matter
            for name, param in model.named_parameters():
                if name.endswith("proj.bias"):
                    param.normal_(0.0, 0.5)
    finally:
        torch.random.set_rng_state(state)
    target = tmp_path_factory.mktemp("biased") / "llama"
    model.save_pretrained(target)
    return target


def test_projection_biases_are_applied(biased_llama: Path, hf_greedy) -> None:
    """o_proj and the MLP's biases (Llama `attention_bias` / `mlp_bias`) reach the output."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, TINY_VOCAB) for _ in range(4 + 5 * i)] for i in range(3)]
    llm = LLM(model=str(biased_llama), max_model_len=64, num_kv_blocks=96, block_size=4)
    try:
        got = _greedy(llm, prompts, 10)
    finally:
        llm.engine.shutdown()
    assert got == [hf_greedy(biased_llama, p, 10, min_gap=1e-4) for p in prompts]
