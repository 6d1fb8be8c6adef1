"""DiffusionGemma under tensor parallelism: two ranks (`mp` executor, gloo) commit the tokens
one rank commits, for a batch of prompts of different lengths with seeded draws, sync and
async, with preemption; unseeded requests draw the same seeds on every rank; a rank holds
half the query heads, its KV heads (the full layers' single KV head replicated), half the
MLP columns and half the experts, and its pool only its KV heads; sizes that do not split
and pipeline parallelism are refused naming the key.

The denoising sampler has no greedy mode (a request's `temperature` is ignored: the
`t_min`..`t_max` schedule rules every step), so every run here is seeded sampling, which is
deterministic given the seeds: tokens equal bit for bit, while logits differ by float32
rounding (the row-parallel sums; see `models/diffusion_gemma_parallel.py`).
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.worker.parallel_state import RankInfo
from tandem.models.diffusion_gemma import kv_bytes_per_token, kv_layer_groups
from tandem.models.diffusion_gemma_layers import moe_grouped, route
from tandem.models.diffusion_gemma_parallel import check_divisible, shard_layers
from tandem.schema.config import ConfigError
from tandem.testing.tiny_diffusion_gemma import DIFFUSION_GEMMA_CONFIGS, tiny_diffusion_gemma

SCHEDULE = {"max_denoising_steps": 3, "t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1}
#: Prompts of 2..11 tokens in one batch.
PROMPTS = [[5, 9, 11, 7, 3, 8, 21, 4, 6, 10, 12], [7, 3], [4, 17, 5, 6, 30]]
SEEDS = [11, 1234, 7]
BASE = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64, diffusion=SCHEDULE)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both tiny configs: `window` (4 layers, sliding layers 2 KV heads x 8, full layers 1
    KV head x 16, canvas 4) and `tf_test` (2 layers, canvas 16); 4 experts top-2 each."""
    paths = {}
    for name, (text, canvas) in DIFFUSION_GEMMA_CONFIGS.items():
        paths[name] = tmp_path_factory.mktemp(f"dg-{name}")
        tiny_diffusion_gemma(text, canvas).save_pretrained(paths[name])
    return paths


def _pair(path: Path, closing: list[LLM], **kw: Any) -> tuple[LLM, LLM]:
    one = LLM(model=str(path), worker_num_threads=1, **{**BASE, **kw})
    two = LLM(model=str(path), tensor_parallel_size=2, **{**BASE, **kw})
    closing += [one, two]
    return one, two


def _tokens(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _seeded(max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, seed=s, ignore_eos=True) for s in SEEDS]


@pytest.mark.parametrize(
    ("name", "async_scheduling", "tight_kv"),
    [("window", False, False), ("window", True, True), ("tf_test", False, False)],
)
def test_two_ranks_commit_one_ranks_tokens(
    name: str,
    async_scheduling: bool,
    tight_kv: bool,
    checkpoints: dict[str, Path],
    closing: list[LLM],
) -> None:
    length = DIFFUSION_GEMMA_CONFIGS[name][1]
    max_tokens = 3 * length + length // 2  # four canvases, the last trimmed
    # tight_kv: about one request's context and canvases at a time (preemptions)
    blocks = (len(PROMPTS[0]) + max_tokens) // 4 + 2 if tight_kv else 64
    kw = dict(async_scheduling=async_scheduling, num_kv_blocks=blocks, max_model_len=4 * blocks)
    one, two = _pair(checkpoints[name], closing, **kw)
    assert two.config.parallel.executor == "mp"
    expected = _tokens(one, _seeded(max_tokens))
    assert [len(t) for t in expected] == [max_tokens] * len(PROMPTS)
    assert _tokens(two, _seeded(max_tokens)) == expected
    if tight_kv:
        assert two.engine.stats()["num_preemptions"] > 0
    ranks = two.engine.executor.collective_rpc("describe")
    assert [r["tp_size"] for r in ranks] == [2, 2]
    # lockstep: the same collectives, of the same sizes, on both ranks
    calls = [(r["collective_calls"], r["collective_bytes"]) for r in ranks]
    assert calls[0] == calls[1] and calls[0][0] > 0


def test_unseeded_requests_draw_the_same_seeds_on_every_rank(
    checkpoints: dict[str, Path], closing: list[LLM]
) -> None:
    """Unseeded requests take seeds from a stream seeded by `model.seed` on every rank, in
    admission order; had a rank drawn others, its committed canvases, hence its share of
    the next canvases' attention, would differ, and so would the tokens."""
    one, two = _pair(checkpoints["window"], closing)
    max_tokens = 12  # three canvases: each one's context holds the previous commits
    free = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * len(PROMPTS)
    got = _tokens(two, free)
    stream = random.Random(two.config.model.seed)
    drawn = [
        SamplingParams(max_tokens=max_tokens, seed=stream.getrandbits(63), ignore_eos=True)
        for _ in PROMPTS
    ]
    assert got == _tokens(one, drawn)


def test_a_rank_holds_its_heads_experts_and_kv_heads(checkpoints: dict[str, Path]) -> None:
    text, canvas = DIFFUSION_GEMMA_CONFIGS["window"]
    full = tiny_diffusion_gemma(text, canvas)
    config = full.config.text_config
    for r in range(2):
        part = tiny_diffusion_gemma(text, canvas)
        encoder, decoder = part.model.encoder.language_model, part.model.decoder
        shard_layers(config, [encoder.layers, decoder.layers], RankInfo(r, 2, 2))
        whole = full.model.encoder.language_model.layers
        for i, layer in enumerate(encoder.layers):
            attn, ref = layer.self_attn, whole[i].self_attn
            dim = attn.head_dim
            assert torch.equal(attn.q_proj.weight, ref.q_proj.weight[r * 2 * dim :][: 2 * dim])
            # sliding layers: KV head r of 2; full layers: their one KV head on both ranks
            kv = ref.k_proj.weight if i % 2 else ref.k_proj.weight[r * dim : (r + 1) * dim]
            assert torch.equal(attn.k_proj.weight, kv)
            assert attn.o_proj.weight.shape == (32, 2 * dim)
            assert layer.mlp.down_proj.weight.shape == (32, 12)
            assert torch.equal(
                layer.experts.gate_up_proj, whole[i].experts.gate_up_proj[2 * r :][:2]
            )
            assert decoder.layers[i].experts.down_proj is layer.experts.down_proj  # still tied
    groups = {g.sliding_window: (g.num_kv_heads, g.head_dim) for g in kv_layer_groups(config, 2)}
    assert groups == {5: (1, 8), None: (1, 16)}
    per_rank = 2 * 4 * (2 * 1 * 8 + 2 * 1 * 16)  # K and V, float32, 2 layers per group
    assert kv_bytes_per_token(full.config, torch.float32, 2) == per_rank
    assert kv_bytes_per_token(full.config, torch.float32) == 2 * 4 * (2 * 2 * 8 + 2 * 1 * 16)


def test_expert_parallel_partials_add_up_to_the_whole_bit_for_bit() -> None:
    """Top-2 over 2 ranks: each token's two expert terms are added in the same order as on
    one rank (and `x + 0 == x`), so the rank partials sum to the one-rank result exactly."""
    text, canvas = DIFFUSION_GEMMA_CONFIGS["window"]
    layer = tiny_diffusion_gemma(text, canvas).model.decoder.layers[0]
    hidden = torch.randn(37, 32, generator=torch.Generator().manual_seed(3))
    weights, index = route(layer.router, hidden)
    with torch.inference_mode():
        whole = moe_grouped(layer.experts, hidden, weights, index)
        parts = []
        for r in range(2):
            experts = SimpleNamespace(
                gate_up_proj=layer.experts.gate_up_proj[2 * r : 2 * r + 2],
                down_proj=layer.experts.down_proj[2 * r : 2 * r + 2],
                act_fn=layer.experts.act_fn,
            )
            parts.append(moe_grouped(experts, hidden, weights, index, first_expert=2 * r))
    assert torch.equal(parts[0] + parts[1], whole)
    assert bool((parts[0] != 0).any()) and bool((parts[1] != 0).any())


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"num_experts": 3}, "text_config.num_experts"),
        ({"intermediate_size": 25}, "text_config.intermediate_size"),
        ({"num_attention_heads": 3, "num_key_value_heads": 3}, "text_config.num_attention_heads"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 3},
            "text_config.num_key_value_heads",
        ),
        ({"num_global_key_value_heads": 3}, "text_config.per_layer_config.1.num_key_value_heads"),
    ],
)
def test_a_size_that_does_not_divide_names_the_key(change: dict[str, int], key: str) -> None:
    text = dict(DIFFUSION_GEMMA_CONFIGS["window"][0], **change)
    from transformers import DiffusionGemmaConfig

    from tandem.testing.tiny_diffusion_gemma import VISION

    config = DiffusionGemmaConfig(text_config=text, vision_config=VISION, canvas_length=4)
    with pytest.raises(ConfigError, match=rf"^parallel\.tensor_parallel_size: 2 .*{key}"):
        check_divisible(config.text_config, 2)
    check_divisible(config.text_config, 1)


def test_an_uneven_checkpoint_and_pipeline_stages_are_refused_at_resolution(
    tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    text, canvas = DIFFUSION_GEMMA_CONFIGS["window"]
    tiny_diffusion_gemma({**text, "num_experts": 3}, canvas).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"^parallel\.tensor_parallel_size: 2 .*num_experts"):
        LLM(model=str(tmp_path), tensor_parallel_size=2, **BASE)
    with pytest.raises(ConfigError, match=r"^parallel\.pipeline_parallel_size: 2 .*pipeline"):
        LLM(model=str(checkpoints["window"]), pipeline_parallel_size=2, **BASE)
