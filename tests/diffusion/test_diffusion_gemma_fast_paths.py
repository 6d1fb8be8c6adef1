"""DiffusionGemma's fast CPU paths equal their references (issue 15, speed).

- `moe_grouped` (two `torch._grouped_mm`, no per-expert loop) equals `moe_reference` (the
  documented reference loop, itself equal to transformers' experts) bit for bit.
- The decoder's context gathered once per canvas (`ContextCache`) gives the logits of the
  per-step gather path (budget 0) within float noise, across steps where some contexts grow
  (rows regathered alone), a different request list (rebuilt), a release, and the sliding
  window moving past old blocks; the pools hold NaN outside what was written, so a
  window left unzeroed shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.models.diffusion_gemma_context import DEFAULT_BUDGET
from tandem.models.diffusion_gemma_layers import (
    _grouped_mm_fits,
    moe_grouped,
    moe_reference,
    route,
)
from tandem.testing.tiny_diffusion_gemma import (
    DIFFUSION_GEMMA_CONFIGS,
    PagedContexts,
    tiny_diffusion_gemma,
)

TOL = 1e-5


@pytest.fixture(scope="module", params=sorted(DIFFUSION_GEMMA_CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    text, canvas = DIFFUSION_GEMMA_CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    tiny_diffusion_gemma(text, canvas).save_pretrained(path)
    return path


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_moe_grouped_equals_the_reference_loop(checkpoint: Path, tokens: int) -> None:
    hf = PagedContexts(checkpoint, num_blocks=1).model.hf
    torch.manual_seed(tokens)
    for layer in [*hf.model.decoder.layers, *hf.model.encoder.language_model.layers]:
        assert _grouped_mm_fits(layer.experts)  # the tiny configs take the grouped path
        hidden = 3.0 * torch.randn(tokens, hf.config.text_config.hidden_size)
        weights, index = route(layer.router, hidden)
        x = layer.pre_feedforward_layernorm_2(hidden)
        with torch.inference_mode():
            assert torch.equal(
                moe_grouped(layer.experts, x, weights, index),
                moe_reference(layer.experts, x, weights, index),
            )


def _both_paths(paged: PagedContexts, reqs: list[str], canvas: torch.Tensor) -> tuple:
    """(cached-path logits, per-step-gather logits) of one denoise call; keeps the cache."""
    cache = paged.model.context_cache
    has = [False] * len(reqs)
    got = paged.denoise(reqs, canvas, None, has)
    saved, cache.groups = cache.groups, {}
    cache.budget_bytes = 0
    want = paged.denoise(reqs, canvas, None, has)
    assert not cache.groups  # over budget: nothing built, the gather path ran
    cache.groups, cache.budget_bytes = saved, DEFAULT_BUDGET
    return got, want


def test_context_gathered_once_equals_per_step_gather(checkpoint: Path) -> None:
    paged = PagedContexts(checkpoint)
    vocab = paged.model.vocab_size
    length = paged.model.canvas_length
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    reqs = ["a", "b", "c", "d"]
    paged.encode([("a", ids(3)), ("b", ids(11)), ("c", ids(6))])
    paged.encode([("d", ids(8))])  # block-aligned windows (nothing to zero) on NaN pools
    cache = paged.model.context_cache
    plans = [
        (reqs, [("b", length)]),  # one row grows: regathered alone
        (reqs, []),  # nothing changes: only the canvas is written
        (reqs, [("a", length), ("c", 2 * length)]),
        (["c", "a"], [("a", length)]),  # another request list: rebuilt
        (["c", "a"], [("c", 3 * length)]),  # past the sliding window
    ]
    built: dict = {}
    for step, (rows, grow) in enumerate(plans):
        if grow:
            paged.encode([(r, ids(n)) for r, n in grow])
        canvas = torch.randint(0, vocab, (len(rows), length), generator=gen)
        got, want = _both_paths(paged, rows, canvas)
        assert not got.isnan().any()
        assert (got - want).abs().max().item() <= TOL, step
        assert all(g.req_ids == tuple(rows) for g in cache.groups.values())
        if step in (1, 2):  # same rows, contexts within capacity: the groups are reused
            assert {k: id(g) for k, g in cache.groups.items()} == built
        built = {k: id(g) for k, g in cache.groups.items()}
    paged.model.release_context("a")
    assert not cache.groups
