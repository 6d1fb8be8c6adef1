"""Step parity: tandem's denoising step (plugins/diffusion_denoise.py) against transformers
5.24's own DiffusionGemma sampler, logits processor and stopping classes on the same logits.

Randomness is compared by replaying the reference's draws: the reference runs its real
`DiffusionGemmaGenerationMixin._denoising_step` (multinomial + randint on torch's global
generator) one request at a time after `torch.manual_seed(seed_r)`, with a stand-in decoder
that returns prepared logits; tandem runs all requests batched, request r on its own
`torch.Generator` seeded `seed_r`. The draws then coincide because the reference at batch 1
consumes its generator exactly as `draw_initial_canvas` / `draw_step_noise` consume a
request's (same calls, shapes, order). No model weights: logits are seeded random tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation import EosTokenCriteria, StoppingCriteriaList
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    DiffusionGemmaGenerationConfig,
    DiffusionGemmaGenerationMixin,
    EntropyBoundSampler,
    EntropyBoundSamplerConfig,
    LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria,
)

from tandem.plugins.diffusion_denoise import (
    CONFIDENCE,
    TOP_K,
    DenoiseSchedule,
    StabilityState,
    acceptance_mask,
    committed_length,
    denoise_step,
    draw_initial_canvas,
    step_generator_seed,
    step_generators,
    step_temperature,
    token_entropy,
)

V, L = 37, 8


@dataclass(frozen=True)
class Req:
    """One request's denoising parameters and how its logits look (sharp: peaked, stable)."""

    seed: int
    steps: int = 6
    t_min: float = 0.4
    t_max: float = 0.8
    bound: float = 0.1
    stability: int = 1
    confidence: float = 0.005
    sharpness: float = 1.0
    jitter: float = 1.0


def schedule_of(reqs: list[Req]) -> DenoiseSchedule:
    return DenoiseSchedule.build(
        max_denoising_steps=[r.steps for r in reqs],
        t_min=[r.t_min for r in reqs],
        t_max=[r.t_max for r in reqs],
        stability_threshold=[r.stability for r in reqs],
        confidence_threshold=[r.confidence for r in reqs],
        acceptance_param=[r.bound for r in reqs],
    )


def step_logits(req: Req) -> list[torch.Tensor]:
    """`steps` logits `[1, L, V]`: a fixed per-request base scaled by `sharpness` plus fresh
    per-step noise, from a private generator (the global one is the reference's)."""
    gen = torch.Generator().manual_seed(1000 + req.seed)
    peak = torch.randint(0, V, (1, L), generator=gen)
    base = torch.randn(1, L, V, generator=gen) + req.sharpness * torch.nn.functional.one_hot(
        peak, V
    )
    return [base + req.jitter * torch.randn(1, L, V, generator=gen) for _ in range(req.steps)]


def reference_canvas(req: Req, logits: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The reference's denoising loop at batch 1 (generate()'s step 1.b-1.c), per step."""
    torch.manual_seed(req.seed)
    sampler = EntropyBoundSampler(
        EntropyBoundSamplerConfig(entropy_bound=req.bound), L, V, req.steps
    )
    processors = LogitsProcessorList(
        [LinearTemperatureScheduleLogitsProcessor(req.t_min, req.t_max, req.steps)]
    )
    stopping = StableAndConfidentStoppingCriteria(req.stability, req.confidence)
    fake_model = SimpleNamespace(
        config=SimpleNamespace(text_config=SimpleNamespace(vocab_size=V)),
        model=SimpleNamespace(
            decoder=SimpleNamespace(embed_tokens=SimpleNamespace(weight=torch.empty(0)))
        ),
    )
    canvas = sampler.initialize_canvas(batch_size=1, device=torch.device("cpu"))
    records = [{"canvas": canvas.clone()}]
    argmax, self_cond = canvas, None
    finished = torch.zeros(1, dtype=torch.bool)
    for i, cur_step in enumerate(reversed(range(1, req.steps + 1))):
        raw = logits[i]
        canvas, argmax, self_cond, finished = DiffusionGemmaGenerationMixin._denoising_step(
            fake_model,
            decoder_forward=lambda raw=raw, **_: SimpleNamespace(logits=raw),
            current_canvas=canvas,
            argmax_canvas=argmax,
            input_ids=None,
            decoder_position_ids=None,
            self_conditioning_logits=self_cond,
            mask_mapping=None,
            cache=None,
            finished_denoising=finished,
            cur_step=cur_step,
            sampler=sampler,
            logits_processor=processors,
            diffusion_stopping_criteria=stopping,
        )
        records.append(
            {
                "canvas": canvas.clone(),
                "argmax": argmax.clone(),
                "accepted": sampler.accepted_token_mask.clone(),
                "processed": self_cond.clone(),
                "finished": finished.clone(),
            }
        )
        if finished.all():
            break
    return records


def tandem_canvases(reqs: list[Req], logits: list[list[torch.Tensor]]) -> list[list[dict]]:
    """All requests batched; a request leaves the batch when its step says commit."""
    schedule = schedule_of(reqs)
    gens = [torch.Generator().manual_seed(r.seed) for r in reqs]
    canvas = draw_initial_canvas(gens, L, V, "cpu")
    out: list[list[dict]] = [[{"canvas": canvas[i : i + 1]}] for i in range(len(reqs))]
    active = torch.arange(len(reqs))
    state = StabilityState.fresh(len(reqs), L, "cpu")
    step = torch.zeros(len(reqs), dtype=torch.long)
    while active.numel():
        batch_logits = torch.cat(
            [logits[int(r)][int(s)] for r, s in zip(active, step, strict=True)]
        )
        res = denoise_step(
            batch_logits,
            canvas,
            step,
            schedule.select(active),
            state,
            [gens[int(r)] for r in active],
        )
        for j, r in enumerate(active.tolist()):
            out[r].append(
                {k: getattr(res, k)[j : j + 1] for k in ("canvas", "argmax_canvas", "accepted")}
            )
            out[r][-1].update(
                processed=res.processed_logits[j : j + 1],
                stop_rule=res.stop_rule[j],
                commit=res.commit[j],
            )
        keep = ~res.commit
        active, canvas, step = active[keep], res.canvas[keep], step[keep] + 1
        state = res.stability.select(keep.nonzero().squeeze(-1))
    return out


REQS = [
    Req(seed=1, sharpness=40.0, jitter=0.01),  # peaked and stable: stops at its 2nd step
    Req(seed=2, sharpness=0.5, steps=5, t_min=0.3, t_max=1.1, bound=0.5),  # flat: runs out
    Req(seed=3, sharpness=6.0, steps=9, bound=1.5, confidence=0.5),  # wavers, then stops
    Req(seed=4, sharpness=40.0, jitter=0.01, stability=0),  # stops at its 1st step
    Req(seed=5, sharpness=30.0, jitter=0.3, stability=2, steps=7, bound=2.0),
    Req(seed=6, sharpness=2.0, steps=1, t_min=0.0, t_max=1.0),  # a single step
]


def test_batched_steps_equal_reference_per_request_with_replayed_draws() -> None:
    logits = [step_logits(r) for r in REQS]
    ours = tandem_canvases(REQS, logits)
    for req, req_logits, mine in zip(REQS, logits, ours, strict=True):
        ref = reference_canvas(req, req_logits)
        assert len(mine) == len(ref), f"seed {req.seed}: steps until commit"
        assert torch.equal(mine[0]["canvas"], ref[0]["canvas"])
        last = len(ref) - 1
        for i in range(1, len(ref)):
            got, want = mine[i], ref[i]
            assert torch.equal(got["accepted"], want["accepted"]), (req.seed, i)
            assert torch.equal(got["canvas"], want["canvas"]), (req.seed, i)
            assert torch.equal(got["argmax_canvas"], want["argmax"]), (req.seed, i)
            assert torch.equal(got["processed"], want["processed"]), (req.seed, i)
            assert bool(got["stop_rule"]) == bool(want["finished"]), (req.seed, i)
            assert bool(got["commit"]) == (i == last), (req.seed, i)


def test_stop_steps_cover_the_edge_cases() -> None:
    logits = [step_logits(r) for r in REQS]
    steps = {r.seed: len(m) - 1 for r, m in zip(REQS, tandem_canvases(REQS, logits), strict=True)}
    assert steps[4] == 1  # stability_threshold 0: stable and confident at the first step
    assert steps[1] == 2  # threshold 1: the earliest stop is the second step
    assert steps[2] == 5  # max_denoising_steps reached: commit the last argmax
    assert steps[3] == 5  # the argmax wavers, then settles before the 9 steps run out
    assert steps[5] == 3  # threshold 2: the earliest stop is the third step
    assert steps[6] == 1  # max_denoising_steps 1


def test_max_denoising_steps_reached_commits_last_argmax_without_the_rule() -> None:
    req = Req(seed=7, sharpness=0.2, steps=3)
    (mine,) = tandem_canvases([req], [step_logits(req)])
    assert [bool(s["stop_rule"]) for s in mine[1:]] == [False, False, False]
    assert [bool(s["commit"]) for s in mine[1:]] == [False, False, True]


def test_adaptive_stopping_off_runs_all_steps() -> None:
    req = Req(seed=1, sharpness=40.0, jitter=0.01, steps=4)
    schedule = DenoiseSchedule.build(
        max_denoising_steps=[4], t_min=[0.4], t_max=[0.8], stability_threshold=[0],
        confidence_threshold=[1.0], acceptance_param=[0.1], adaptive_stopping=[False],
    )  # fmt: skip
    gens = [torch.Generator().manual_seed(1)]
    canvas, state = draw_initial_canvas(gens, L, V, "cpu"), StabilityState.fresh(1, L, "cpu")
    for i, raw in enumerate(step_logits(req)):
        res = denoise_step(raw, canvas, torch.tensor([i]), schedule, state, gens)
        assert bool(res.stable & res.confident) and not bool(res.stop_rule)
        assert bool(res.commit) == (i == 3)
        canvas, state = res.canvas, res.stability


@pytest.mark.parametrize("steps", [1, 2, 7, 48])
@pytest.mark.parametrize(("t_min", "t_max"), [(0.4, 0.8), (0.0, 1.0), (0.3, 1.1), (0.05, 0.07)])
def test_temperature_equals_linear_schedule_processor_bitwise(
    steps: int, t_min: float, t_max: float
) -> None:
    raw = torch.randn(steps, L, V, generator=torch.Generator().manual_seed(steps))
    schedule = DenoiseSchedule.build(
        max_denoising_steps=[steps] * steps, t_min=[t_min] * steps, t_max=[t_max] * steps,
        stability_threshold=[1] * steps, confidence_threshold=[0.005] * steps,
        acceptance_param=[0.1] * steps,
    )  # fmt: skip
    index = torch.arange(steps)
    ours = raw / step_temperature(schedule, index)[:, None, None]
    proc = LinearTemperatureScheduleLogitsProcessor(t_min, t_max, steps)
    for i in range(steps):
        cur = torch.tensor(steps - i, dtype=torch.int32)
        assert torch.equal(ours[i], proc(None, raw[i], cur_step=cur))


def test_temperature_schedule_endpoints() -> None:
    schedule = DenoiseSchedule.build(
        max_denoising_steps=[48, 48], t_min=[0.4, 0.4], t_max=[0.8, 0.8],
        stability_threshold=[1, 1], confidence_threshold=[0.005, 0.005], acceptance_param=[0.1, 0.1],
    )  # fmt: skip
    first, last = step_temperature(schedule, torch.tensor([0, 47])).tolist()
    assert first == pytest.approx(0.8, abs=1e-7)  # t_max at the first step
    assert last == pytest.approx(0.4 + 0.4 / 48, abs=1e-7)  # never reaches t_min


def test_token_entropy_equals_categorical_bitwise() -> None:
    logits = torch.randn(3, L, V, generator=torch.Generator().manual_seed(0)) * 8
    logits[0, 0] = -float("inf")
    logits[0, 0, 3] = 5.0  # a one-hot row: -inf logits
    logits[1, 2] = 0.0  # a uniform row
    ref = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.equal(token_entropy(logits), ref)


def test_entropy_bound_acceptance_equals_sampler_with_ties_and_per_request_bounds() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, L, V, generator=gen) * 3
    logits[1] = logits[1, :1].expand(L, V)  # every position has the same entropy
    logits[2, :4] = 0.0  # a group of maximal, tied entropies
    bounds = [0.1, 0.5, 3.0, 100.0]
    schedule = DenoiseSchedule.build(
        max_denoising_steps=[4] * 4, t_min=[0.4] * 4, t_max=[0.8] * 4, stability_threshold=[1] * 4,
        confidence_threshold=[0.005] * 4, acceptance_param=bounds,
    )  # fmt: skip
    mine = acceptance_mask(token_entropy(logits), logits.softmax(-1), schedule)
    current, candidate = torch.zeros(1, L, dtype=torch.long), torch.ones(1, L, dtype=torch.long)
    for r, bound in enumerate(bounds):
        sampler = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=bound), L, V, 4)
        accepted = sampler.accept_canvas(current, candidate, logits[r : r + 1], 4)
        assert torch.equal(mine[r : r + 1], sampler.accepted_token_mask)
        assert torch.equal(accepted, mine[r : r + 1].long())
    assert bool(mine.any(dim=-1).all())  # the lowest-entropy position is always accepted
    assert bool(mine[3].all())


def test_stability_run_equals_reference_history() -> None:
    """Argmax canvases that repeat, change and come back; thresholds 0..3."""
    pattern = [0, 0, 1, 1, 1, 1, 0, 1, 1, 1]
    canvases = torch.stack([torch.full((L,), 5 + p) for p in pattern])
    onehot = torch.nn.functional.one_hot(canvases, V).float() * 50.0
    for threshold in range(4):
        ref = StableAndConfidentStoppingCriteria(threshold, confidence_threshold=1.0)
        schedule = DenoiseSchedule.build(
            max_denoising_steps=[99], t_min=[0.4], t_max=[0.8], stability_threshold=[threshold],
            confidence_threshold=[1.0], acceptance_param=[0.1],
        )  # fmt: skip
        state = StabilityState.fresh(1, L, "cpu")
        for s in range(len(pattern)):
            logits = onehot[s][None]
            want = ref(canvases[s][None], logits)
            res = denoise_step(
                logits, canvases[s][None], torch.tensor([s]), schedule, state,
                [torch.Generator().manual_seed(s)],
            )  # fmt: skip
            assert torch.equal(res.stop_rule, want), (threshold, s)
            state = res.stability


def test_eos_trim_matches_finalize_canvas() -> None:
    eos, pad = [2, 9], 0
    canvases = torch.tensor(
        [
            [4, 5, 2, 6, 2, 7, 8, 3],  # EOS mid-canvas, again later
            [9, 5, 5, 6, 3, 7, 8, 3],  # EOS first
            [4, 5, 5, 6, 3, 7, 8, 2],  # EOS last
            [4, 5, 5, 6, 3, 7, 8, 3],  # none
        ]
    )
    prompt = torch.full((4, 3), 11)
    config = DiffusionGemmaGenerationConfig(eos_token_id=eos, pad_token_id=pad)
    ref_ids, ref_finished = DiffusionGemmaGenerationMixin._finalize_canvas(
        input_ids=torch.cat([prompt, canvases], dim=-1),
        finished_sequences=torch.zeros(4, dtype=torch.bool),
        generation_config=config,
        stopping_criteria=StoppingCriteriaList([EosTokenCriteria(eos)]),
        canvas_length=L,
        eos_tensor=torch.tensor(eos),
    )
    length, hit = committed_length(canvases, eos)
    assert torch.equal(hit, ref_finished)
    assert length.tolist() == [3, 1, 8, 8]
    for r in range(4):
        kept = ref_ids[r, 3 : 3 + int(length[r])]
        assert torch.equal(kept, canvases[r, : int(length[r])])
        assert bool((ref_ids[r, 3 + int(length[r]) :] == pad).all())
    no_eos_length, no_eos_hit = committed_length(canvases, [])
    assert no_eos_length.tolist() == [L] * 4 and not bool(no_eos_hit.any())


def test_top_k_accepts_the_k_lowest_entropy_positions() -> None:
    logits = torch.randn(3, L, V, generator=torch.Generator().manual_seed(5)) * 4
    entropy = token_entropy(logits)
    schedule = DenoiseSchedule.build(
        max_denoising_steps=[4] * 3, t_min=[0.4] * 3, t_max=[0.8] * 3, stability_threshold=[1] * 3,
        confidence_threshold=[0.005] * 3, acceptance_param=[1, 3, 99], acceptance=TOP_K,
    )  # fmt: skip
    mask = acceptance_mask(entropy, logits.softmax(-1), schedule)
    assert mask.sum(-1).tolist() == [1, 3, L]
    for r in range(2):
        assert bool(entropy[r][mask[r]].max() <= entropy[r][~mask[r]].min())


def test_confidence_threshold_accepts_confident_positions_and_at_least_one() -> None:
    probs = torch.full((2, L, V), 0.5 / (V - 1))
    probs[:, :, 0] = 0.5
    probs[0, 3] = 0.0
    probs[0, 3, 1] = 0.95
    schedule = DenoiseSchedule.build(
        max_denoising_steps=[4] * 2, t_min=[0.4] * 2, t_max=[0.8] * 2, stability_threshold=[1] * 2,
        confidence_threshold=[0.005] * 2, acceptance_param=[0.9, 0.99], acceptance=CONFIDENCE,
    )  # fmt: skip
    mask = acceptance_mask(token_entropy(probs.log()), probs, schedule)
    assert mask[0].nonzero().flatten().tolist() == [3]  # >= 0.9
    assert mask[1].sum() == 1  # none >= 0.99: the most confident one alone


def test_step_generators_are_per_request_and_deterministic() -> None:
    assert step_generator_seed(7, 0, -1) != step_generator_seed(7, 0, 0)
    assert step_generator_seed(7, 1, 0) != step_generator_seed(7, 0, 1)
    assert step_generator_seed(2**64 - 1, 3, 4) < 2**64
    probs = torch.rand(2, L, V, generator=torch.Generator().manual_seed(0))
    schedule = schedule_of([Req(seed=0), Req(seed=0)])

    def run(seeds: list[int]) -> torch.Tensor:
        gens = step_generators(seeds, [0, 0], [2, 2], "cpu")
        state = StabilityState.fresh(2, L, "cpu")
        canvas = torch.zeros(2, L, dtype=torch.long)
        return denoise_step(probs, canvas, torch.tensor([2, 2]), schedule, state, gens).canvas

    a, b = run([11, 12]), run([99, 12])
    assert torch.equal(run([11, 12]), a)  # deterministic
    assert torch.equal(a[1], b[1])  # request 1 is unaffected by request 0's seed
    assert not torch.equal(a[0], b[0])
