"""Issue 15 parity (a): DiffusionGemma's canvas logits on tandem's paged KV equal transformers'.

Two tiny random DiffusionGemma checkpoints (`tandem.testing.tiny_diffusion_gemma`: saved
with `save_pretrained`, loaded back from the directory, nothing downloads): `tf_test`,
transformers' own test shape (a sliding window larger than every context), and `window`
(sliding window 5, contexts far longer than it). The reference is the model's own code path
as `generate()` drives it (`reference_logits`), one request at a time.
tandem encodes the same contexts through its paged pools (in arbitrary chunks, batched with
other requests) and denoises every canvas in one batched call. fp32, max abs diff <= 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

from tandem.core.worker.block_diffusion import is_block_diffusion
from tandem.models.diffusion_gemma import DiffusionGemmaModel
from tandem.models.diffusion_gemma_layers import moe_reference, route
from tandem.models.kv_layer_groups import KVPools, bytes_per_block, single_group
from tandem.testing.tiny_diffusion_gemma import (
    BLOCK,
    DIFFUSION_GEMMA_CONFIGS,
    VISION,
    PagedContexts,
    reference_logits,
    tiny_diffusion_gemma,
)

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(DIFFUSION_GEMMA_CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    text, canvas = DIFFUSION_GEMMA_CONFIGS[request.param]
    model = tiny_diffusion_gemma(text, canvas)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path


def _workload(vocab: int, length: int, seed: int) -> list[tuple[list[int], list[list[int]]]]:
    """(prompt, committed canvases) per request: mixed prompt lengths and canvas counts."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 0), (13, 1), (6, 2), (1, 3), (9, 0)]

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    return [(ids(p), [ids(length) for _ in range(k)]) for p, k in shapes]


def _step_inputs(rows: int, length: int, vocab: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    canvas = torch.randint(0, vocab, (rows, length), generator=gen)
    sc = 2.0 * torch.randn(rows, length, vocab, generator=gen)
    has = [r % 2 == 1 for r in range(rows)]
    return canvas, sc, has


def _check(paged: PagedContexts, hf, reqs, work, seed: int) -> torch.Tensor:  # noqa: ANN001
    """Denoise every request in one batch; compare each row with the reference."""
    vocab, length = paged.model.vocab_size, paged.model.canvas_length
    canvas, sc, has = _step_inputs(len(reqs), length, vocab, seed)
    before = [t.clone() for pair in paged.model.kv.per_layer for t in pair]
    got = paged.denoise(reqs, canvas, sc, has)
    after = [t for pair in paged.model.kv.per_layer for t in pair]
    unchanged = [
        torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before, after, strict=True)
    ]
    assert all(unchanged), "denoise wrote KV"
    assert not got.isnan().any()
    assert got.shape == (len(reqs), length, vocab) and got.dtype == torch.float32
    worst = 0.0
    for r, (prompt, canvases) in enumerate(work):
        ref = reference_logits(hf, prompt, canvases, canvas[r], sc[r] if has[r] else None)
        worst = max(worst, (got[r] - ref).abs().max().item())
    assert worst <= TOL, f"max abs diff {worst}"
    return got


def _encode_all(paged: PagedContexts, reqs: list[str], work, chunk: int) -> None:  # noqa: ANN001
    """Prompts in `chunk`-token pieces, all requests batched per call, then canvases one per
    call (as commits arrive)."""
    prompts = {r: list(p) for r, (p, _) in zip(reqs, work, strict=True)}
    while any(prompts.values()):
        batch = [(r, prompts[r][:chunk]) for r in reqs if prompts[r]]
        for r, _ in batch:
            prompts[r] = prompts[r][chunk:]
        paged.encode(batch)
    for k in range(max(len(c) for _, c in work)):
        paged.encode([(r, c[k]) for r, (_, c) in zip(reqs, work, strict=True) if len(c) > k])


def test_diffusion_gemma_is_a_block_diffusion_model(checkpoint: Path) -> None:
    paged = PagedContexts(checkpoint)
    assert is_block_diffusion(paged.model)
    assert (
        paged.model.canvas_length
        == DIFFUSION_GEMMA_CONFIGS[checkpoint.name.rstrip("0123456789")][1]
    )


@pytest.mark.parametrize("chunk", [5, 64])
def test_batched_canvas_logits_equal_transformers(checkpoint: Path, chunk: int) -> None:
    paged = PagedContexts(checkpoint)
    hf = paged.model.hf
    work = _workload(paged.model.vocab_size, paged.model.canvas_length, seed=chunk)
    reqs = [f"r{i}" for i in range(len(work))]
    _encode_all(paged, reqs, work, chunk)
    _check(paged, hf, reqs, work, seed=1)
    _check(paged, hf, reqs[::-1], work[::-1], seed=2)  # another order, another step


def test_prefix_cache_hit_and_preemption_recompute(checkpoint: Path) -> None:
    paged = PagedContexts(checkpoint)
    hf = paged.model.hf
    vocab, length = paged.model.vocab_size, paged.model.canvas_length
    (prompt, canvases), (other, _) = _workload(vocab, length, seed=7)[1:3]
    shared = 3 * BLOCK  # B's prefix-cache hit: A's first three full blocks
    prompt_b = prompt[:shared] + other
    paged.encode([("a", prompt)])
    paged.tables["b"] = list(paged.tables["a"][:3])
    paged.lens["b"] = shared
    paged.encode([("b", other), ("a", canvases[0])])
    work = [(prompt, canvases[:1]), (prompt_b, [])]
    first = _check(paged, hf, ["a", "b"], work, seed=3)
    # Preempt both (blocks back to the pool, taken again in another order: other slots),
    # recompute from scratch in other chunks; the same step gives the same logits.
    paged.release("a")
    paged.release("b")
    paged.free.reverse()
    paged.encode([("b", prompt_b[:7]), ("a", prompt + canvases[0])])
    paged.encode([("b", prompt_b[7:])])
    again = _check(paged, hf, ["a", "b"], work, seed=3)
    assert (again - first).abs().max().item() <= TOL


def test_kv_pools_are_per_layer_group_with_one_slot_mapping(checkpoint: Path) -> None:
    model = PagedContexts(checkpoint, num_blocks=8).model
    text = model.text_config
    groups = model.kv_groups
    if checkpoint.name.startswith("window"):
        assert [
            (g.layer_indices, g.num_kv_heads, g.head_dim, g.sliding_window) for g in groups
        ] == [
            ((0, 2), 2, 8, 5),
            ((1, 3), 1, 16, None),
        ]
    else:  # same shape, but the sliding layer and the full layer attend differently
        assert [(g.layer_indices, g.sliding_window) for g in groups] == [((0,), 512), ((1,), None)]
    for layer, (k, v) in enumerate(model.kv.per_layer):
        lc = text.per_layer_config[layer]
        assert k.shape == v.shape == (8, BLOCK, lc.num_key_value_heads, lc.head_dim)
        assert k.data_ptr() != v.data_ptr()
    assert model.kv.nbytes() == 8 * bytes_per_block(groups, BLOCK, torch.float32)
    # One slot mapping addresses the same (block, offset) in every group's pools.
    pools = KVPools(groups, 8, BLOCK, torch.float32, torch.device("cpu"))
    slots = torch.tensor([5, 17])
    for layer, (k, _) in enumerate(pools.per_layer):
        pools.write(
            layer, torch.full((2, *k.shape[2:]), float(layer)), torch.zeros(2, *k.shape[2:]), slots
        )
        assert torch.equal(k[1, 1], torch.full(k.shape[2:], float(layer)))
        assert torch.equal(k[4, 1], torch.full(k.shape[2:], float(layer)))


def test_single_group_and_shared_kv_pools() -> None:
    (group,) = single_group(num_layers=3, num_kv_heads=2, head_dim=4)
    assert (
        group.layer_indices == (0, 1, 2)
        and group.bytes_per_token(torch.float32) == 2 * 3 * 2 * 4 * 4
    )
    shared = type(group)(
        num_layers=1, num_kv_heads=1, head_dim=4, shares_kv=True, layer_indices=(0,)
    )
    pools = KVPools([shared], 2, BLOCK, torch.float32, torch.device("cpu"))
    k, v = pools.per_layer[0]
    assert k is v and pools.nbytes() == 2 * BLOCK * 4 * 4


def test_moe_reference_equals_transformers_router_and_experts(checkpoint: Path) -> None:
    hf = PagedContexts(checkpoint, num_blocks=1).model.hf
    for layer in [*hf.model.decoder.layers, *hf.model.encoder.language_model.layers]:
        hidden = 3.0 * torch.randn(37, hf.config.text_config.hidden_size)
        _, ref_weights, ref_index = layer.router(hidden)
        weights, index = route(layer.router, hidden)
        assert torch.equal(weights, ref_weights) and torch.equal(index, ref_index)
        x = layer.pre_feedforward_layernorm_2(hidden)
        with torch.no_grad():
            assert torch.equal(
                moe_reference(layer.experts, x, weights, index), layer.experts(x, index, weights)
            )


def test_bfloat16_runs_the_same_path(checkpoint: Path) -> None:
    """bf16 (the CUDA dtype) on the CPU: bf16 pools, float32 logits, finite, near the fp32
    reference on average. Not a parity check: a 1-2 ulp bf16 difference in a layer's
    hidden state can flip a top-2 expert choice, which moves that token's logits by O(1)."""
    paged = PagedContexts(checkpoint, dtype=torch.bfloat16)
    assert all(k.dtype == v.dtype == torch.bfloat16 for k, v in paged.model.kv.per_layer)
    vocab, length = paged.model.vocab_size, paged.model.canvas_length
    work = _workload(vocab, length, seed=11)
    reqs = [f"r{i}" for i in range(len(work))]
    _encode_all(paged, reqs, work, chunk=6)
    canvas, sc, has = _step_inputs(len(reqs), length, vocab, seed=4)
    got = paged.denoise(reqs, canvas, sc.to(torch.bfloat16), has)
    assert got.dtype == torch.float32 and got.isfinite().all()
    fp32 = PagedContexts(checkpoint).model.hf
    refs = [
        reference_logits(
            fp32, p, c, canvas[r], sc.to(torch.bfloat16)[r].float() if has[r] else None
        )
        for r, (p, c) in enumerate(work)
    ]
    assert (got - torch.stack(refs)).abs().mean().item() < 0.1


def test_bidirectional_encoder_is_refused(tmp_path: Path) -> None:
    text = {**DIFFUSION_GEMMA_CONFIGS["window"][0], "use_bidirectional_attention": "all"}
    config = DiffusionGemmaConfig(text_config=text, vision_config=VISION, canvas_length=4)
    DiffusionGemmaForBlockDiffusion(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        DiffusionGemmaModel(tmp_path, torch.float32, 4, BLOCK, torch.device("cpu"))
