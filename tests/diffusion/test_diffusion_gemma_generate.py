"""Toward issue 15 parity (c), below the scheduler: tandem's DiffusionGemma forward plus its
denoising step generate transformers' `generate()` tokens, batched.

A small driver (no scheduler, no runner) plays the engine: requests of different prompt
lengths and step budgets share every `encode` and `denoise` call, leave and rejoin the batch
at their own commits (step budget exhausted or the stopping rule, at different steps), re-encode each committed canvas before their next one, and own one generator each,
seeded like `torch.manual_seed(seed)` before the reference's batch-1 `generate()` (the draw
order of docs/diffusion-reference.md section 5). Every request's tokens must equal its own
batch-1 `generate()` run token for token, trimmed after the first EOS.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.plugins.diffusion_denoise import (
    DenoiseSchedule,
    StabilityState,
    committed_length,
    denoise_step,
    draw_initial_canvas,
)
from tandem.testing.tiny_diffusion_gemma import (
    DIFFUSION_GEMMA_CONFIGS,
    PagedContexts,
    tiny_diffusion_gemma,
)

T_MIN, T_MAX, BOUND, CANVASES = 0.4, 0.8, 0.1, 2
#: Per request: different step budgets stagger the commits (requests leave and join).
STEPS = [4, 2, 3]
PROMPTS = [[5, 9, 11, 7, 3, 8, 21, 4, 6, 10, 12], [7, 3], [4, 17, 5, 6, 30, 8]]
SEEDS = [11, 1234, 7]
#: Per config, a confidence threshold at which the stopping rule fires at mixed steps.
MID_CONFIDENCE = {"tf_test": 4.0, "window": 3.9}


@pytest.fixture(scope="module", params=sorted(DIFFUSION_GEMMA_CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    text, canvas = DIFFUSION_GEMMA_CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    tiny_diffusion_gemma(text, canvas).save_pretrained(path)
    return path


class Row:
    """One request's denoising state between steps (what the runner keeps)."""

    def __init__(self, canvas: torch.Tensor, length: int) -> None:
        self.canvas = canvas
        self.self_cond: torch.Tensor | None = None
        self.step = 0
        self.stability = StabilityState.fresh(1, length, "cpu")


def tandem_generate(
    paged: PagedContexts, eos: list[int], stability: int, confidence: float
) -> list[list[int]]:
    model = paged.model
    length, vocab, n = model.canvas_length, model.vocab_size, len(PROMPTS)
    gens = [torch.Generator().manual_seed(s) for s in SEEDS]
    schedule = DenoiseSchedule.build(
        max_denoising_steps=STEPS, t_min=[T_MIN] * n, t_max=[T_MAX] * n,
        stability_threshold=[stability] * n, confidence_threshold=[confidence] * n,
        acceptance_param=[BOUND] * n,
    )  # fmt: skip
    out: list[list[int]] = [[] for _ in range(n)]
    to_encode = {r: list(PROMPTS[r]) for r in range(n)}
    rows: dict[int, Row] = {}
    commits = [0] * n
    for _ in range(CANVASES * (max(STEPS) + 1) + 2):  # bounded: every request ends by then
        active = [r for r in range(n) if commits[r] < CANVASES]
        if not active:
            break
        pending = [(str(r), to_encode.pop(r)) for r in active if r in to_encode]
        if pending:
            paged.encode(pending)
        for r in active:
            if r not in rows:
                rows[r] = Row(draw_initial_canvas([gens[r]], length, vocab, "cpu")[0], length)
        batch = [rows[r] for r in active]
        has = [row.self_cond is not None for row in batch]
        self_cond = torch.stack(
            [
                row.self_cond if row.self_cond is not None else torch.zeros(length, vocab)
                for row in batch
            ]
        )
        canvas = torch.stack([row.canvas for row in batch])
        logits = paged.denoise([str(r) for r in active], canvas, self_cond, has)
        state = StabilityState(
            prev_argmax=torch.cat([row.stability.prev_argmax for row in batch]),
            stable_run=torch.cat([row.stability.stable_run for row in batch]),
        )
        steps = torch.tensor([row.step for row in batch])
        res = denoise_step(
            logits,
            canvas,
            steps,
            schedule.select(torch.tensor(active)),
            state,
            [gens[r] for r in active],
        )
        for j, r in enumerate(active):
            if bool(res.commit[j]):
                committed = res.argmax_canvas[j]
                count, hit = committed_length(committed[None], eos)
                out[r] += committed[: int(count[0])].tolist()
                commits[r] = CANVASES if bool(hit[0]) else commits[r] + 1
                to_encode[r] = committed.tolist()  # the whole argmax canvas, as the reference
                del rows[r]
                continue
            row = rows[r]
            row.canvas, row.self_cond, row.step = (
                res.canvas[j],
                res.processed_logits[j],
                row.step + 1,
            )
            row.stability = res.stability.select(torch.tensor([j]))
    assert all(c == CANVASES for c in commits), "the driver ran out of steps"
    return out


def reference_generate(
    hf: torch.nn.Module, r: int, eos: list[int], stability: int, confidence: float
) -> list[int]:
    """Request r alone through `generate()`, after `torch.manual_seed(SEEDS[r])`."""
    prompt = PROMPTS[r]
    torch.manual_seed(SEEDS[r])
    length = hf.config.canvas_length
    seq = hf.generate(
        torch.tensor([prompt]), max_new_tokens=CANVASES * length, max_denoising_steps=STEPS[r],
        t_min=T_MIN, t_max=T_MAX, stability_threshold=stability, confidence_threshold=confidence,
        eos_token_id=eos or None,
    ).sequences[0, len(prompt) :].tolist()  # fmt: skip
    first_eos = next((i for i, t in enumerate(seq) if t in eos), None)
    return seq if first_eos is None else seq[: first_eos + 1]


@pytest.mark.parametrize(
    ("stability", "confidence"),
    [(1, 0.005), (0, 50.0), (0, None)],  # all steps / the first step / in between
)
def test_batched_tandem_generation_equals_per_request_generate(
    checkpoint: Path, stability: int, confidence: float | None
) -> None:
    if confidence is None:  # near the mean entropy: requests stop at different steps
        confidence = MID_CONFIDENCE[checkpoint.name.rstrip("0123456789")]
    paged = PagedContexts(checkpoint)
    hf = paged.model.hf
    eos_id = hf.generation_config.eos_token_id
    eos = [] if eos_id is None else list(eos_id) if isinstance(eos_id, list) else [eos_id]
    got = tandem_generate(paged, eos, stability, confidence)
    for r in range(len(PROMPTS)):
        assert got[r] == reference_generate(hf, r, eos, stability, confidence), r


def test_eos_inside_a_canvas_ends_the_request_as_generate_does(checkpoint: Path) -> None:
    """EOS = a token request 0 commits in its first canvas: it ends there, trimmed after
    the first EOS (the reference pads the rest); the others go on unless they hit it too."""
    free_run = tandem_generate(PagedContexts(checkpoint), [], 1, 0.005)
    eos = [free_run[0][2]]
    paged = PagedContexts(checkpoint)
    got = tandem_generate(paged, eos, 1, 0.005)
    assert len(got[0]) <= 3 and got[0][-1] == eos[0]
    for r in range(len(PROMPTS)):
        assert got[r] == reference_generate(paged.model.hf, r, eos, 1, 0.005), r


def test_denoise_context_rows_are_independent(checkpoint: Path) -> None:
    """A request's logits do not depend on which other requests share its batch."""
    paged = PagedContexts(checkpoint)
    length, vocab = paged.model.canvas_length, paged.model.vocab_size
    paged.encode([(str(r), p) for r, p in enumerate(PROMPTS)])
    canvas = torch.randint(
        0, vocab, (len(PROMPTS), length), generator=torch.Generator().manual_seed(0)
    )
    together = paged.denoise(["0", "1", "2"], canvas, None, [False] * 3)
    alone = paged.denoise(["1"], canvas[1:2], None, [False])
    assert (together[1] - alone[0]).abs().max().item() <= 1e-5
