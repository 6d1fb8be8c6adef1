"""DiffusionGemma's denoising step as pure, batched torch functions (no plugin class yet).

One call of `denoise_step` is one denoising step for every request in the batch: from the
decoder's raw canvas logits `[R, L, V]` (float32) it applies the linear temperature
schedule, draws a candidate canvas, picks the accepted positions (entropy bound as
transformers 5.24's `EntropyBoundSampler`, or the confidence-threshold / top-k options),
renoises the others with uniform random tokens and evaluates the stable-and-confident
stopping rule (`StableAndConfidentStoppingCriteria`). On the same logits and the same random
draws it equals transformers bit for bit (tests/diffusion/test_denoise_step_parity.py);
docs/diffusion-reference.md says how the reference works and what differs.

Randomness: each request owns a `torch.Generator`. Per step a request draws, in this order,
`multinomial(probs[r] [L, V], 1)` then `randint(0, V, (L,))`; a canvas starts with one
`randint(0, V, (L,))` (`draw_initial_canvas`). These are exactly the reference's draws at
batch 1, so one generator per request seeded once with s and consumed in order replays
`torch.manual_seed(s); model.generate(...)`. `step_generator_seed` derives a generator seed
from (seed, canvas index, step) instead, so a step's draws depend on nothing else (preemption,
async placeholders); that does not replay `generate()` unless the reference is fed the same
generators. The draws are the only per-request Python loop (each request has its own
generator); everything else is one tensor op over the batch.

Step indices are tandem's: `step_index` counts the steps already done in the current canvas
(0 at a canvas's first step). The reference counts the steps *remaining*:
`cur_step = max_denoising_steps - step_index`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ENTROPY_BOUND = "entropy_bound"
CONFIDENCE = "confidence"
TOP_K = "top_k"
ACCEPTANCE_RULES = (ENTROPY_BOUND, CONFIDENCE, TOP_K)

_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class DenoiseSchedule:
    """Per-request denoising parameters: every tensor has one entry per request (`[R]`).

    `t_span` is float32(t_max - t_min) with the difference taken in float64 first, as the
    reference's Python arithmetic does. `acceptance_param` is the entropy bound (float32),
    the confidence threshold (float32) or k (int64), by `acceptance`. `adaptive_stopping`
    False disables the stable-and-confident rule (the reference without
    stability/confidence thresholds): such a request commits after `max_denoising_steps`.
    """

    max_denoising_steps: torch.Tensor
    t_min: torch.Tensor
    t_span: torch.Tensor
    stability_threshold: torch.Tensor
    confidence_threshold: torch.Tensor
    adaptive_stopping: torch.Tensor
    acceptance: str
    acceptance_param: torch.Tensor

    @classmethod
    def build(
        cls,
        *,
        max_denoising_steps: Sequence[int],
        t_min: Sequence[float],
        t_max: Sequence[float],
        stability_threshold: Sequence[int],
        confidence_threshold: Sequence[float],
        acceptance_param: Sequence[float],
        acceptance: str = ENTROPY_BOUND,
        adaptive_stopping: Sequence[bool] | None = None,
        device: torch.device | str = "cpu",
    ) -> DenoiseSchedule:
        """Build from per-request Python values (one entry per request, same order)."""
        if acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance: {acceptance!r} is not one of {ACCEPTANCE_RULES}")
        n = len(max_denoising_steps)
        stopping = [True] * n if adaptive_stopping is None else list(adaptive_stopping)
        param_dtype = torch.int64 if acceptance == TOP_K else torch.float32
        f32, i64 = torch.float32, torch.int64
        return cls(
            max_denoising_steps=torch.tensor(max_denoising_steps, dtype=i64, device=device),
            t_min=torch.tensor(t_min, dtype=f32, device=device),
            t_span=torch.tensor(
                [b - a for a, b in zip(t_min, t_max, strict=True)], dtype=f32, device=device
            ),
            stability_threshold=torch.tensor(stability_threshold, dtype=i64, device=device),
            confidence_threshold=torch.tensor(confidence_threshold, dtype=f32, device=device),
            adaptive_stopping=torch.tensor(stopping, dtype=torch.bool, device=device),
            acceptance=acceptance,
            acceptance_param=torch.tensor(acceptance_param, dtype=param_dtype, device=device),
        )

    def select(self, index: torch.Tensor) -> DenoiseSchedule:
        """The rows `index` (e.g. the requests still denoising), in that order."""
        return DenoiseSchedule(
            max_denoising_steps=self.max_denoising_steps[index],
            t_min=self.t_min[index],
            t_span=self.t_span[index],
            stability_threshold=self.stability_threshold[index],
            confidence_threshold=self.confidence_threshold[index],
            adaptive_stopping=self.adaptive_stopping[index],
            acceptance=self.acceptance,
            acceptance_param=self.acceptance_param[index],
        )


@dataclass(frozen=True)
class StabilityState:
    """Per-request stopping state, kept by the runner across a canvas's steps.

    `prev_argmax [R, L]` is the previous step's argmax canvas (-1 before the first step) and
    `stable_run [R]` how many consecutive previous steps had the current argmax canvas. The
    reference keeps the last `stability_threshold` argmax canvases instead; "all of them
    equal the current one" is `stable_run >= stability_threshold` (token ids are never -1).
    """

    prev_argmax: torch.Tensor
    stable_run: torch.Tensor

    @classmethod
    def fresh(
        cls, num_requests: int, canvas_length: int, device: torch.device | str
    ) -> StabilityState:
        """The state at the start of a canvas (and after a preemption restarts it)."""
        return cls(
            prev_argmax=torch.full(
                (num_requests, canvas_length), -1, dtype=torch.long, device=device
            ),
            stable_run=torch.zeros(num_requests, dtype=torch.long, device=device),
        )

    def select(self, index: torch.Tensor) -> StabilityState:
        """The rows `index`, in that order."""
        return StabilityState(
            prev_argmax=self.prev_argmax[index], stable_run=self.stable_run[index]
        )


@dataclass(frozen=True)
class DenoiseStepResult:
    """What one denoising step returns, all `[R, ...]`.

    `canvas` is the next step's decoder input; `processed_logits` (temperature-scaled) are
    the next step's self-conditioning logits (the reference casts them to the embedding
    dtype). `commit` = `stop_rule | exhausted`: commit `argmax_canvas` now.
    """

    canvas: torch.Tensor
    accepted_canvas: torch.Tensor
    accepted: torch.Tensor
    renoised: torch.Tensor
    argmax_canvas: torch.Tensor
    processed_logits: torch.Tensor
    stable: torch.Tensor
    confident: torch.Tensor
    stop_rule: torch.Tensor
    exhausted: torch.Tensor
    commit: torch.Tensor
    stability: StabilityState


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def step_generator_seed(seed: int, canvas_index: int, step: int) -> int:
    """A 64-bit generator seed for (request seed, canvas index, step); step -1 is the draw of
    the canvas's initial random tokens, step s >= 0 the draws of denoising step s."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _M64) ^ canvas_index) ^ (step + 1))


def step_generators(
    seeds: Sequence[int],
    canvas_indices: Sequence[int],
    steps: Sequence[int],
    device: torch.device | str,
) -> list[torch.Generator]:
    """One fresh generator per request, seeded by `step_generator_seed`."""
    gens = []
    for seed, canvas, step in zip(seeds, canvas_indices, steps, strict=True):
        gen = torch.Generator(device=device)
        gen.manual_seed(step_generator_seed(seed, canvas, step))
        gens.append(gen)
    return gens


def step_temperature(schedule: DenoiseSchedule, step_index: torch.Tensor) -> torch.Tensor:
    """`[R]` float32: t_min + (t_max - t_min) * (cur_step / N), cur_step = N - step_index.

    t_max at a canvas's first step, t_min + (t_max - t_min) / N at its last (never t_min).
    Matches `LinearTemperatureScheduleLogitsProcessor` bit for bit: on CUDA the reference's
    `int32 tensor / python int` runs as a multiplication by the float32 reciprocal, so does
    this.
    """
    cur = (schedule.max_denoising_steps - step_index).to(torch.int32)
    steps = schedule.max_denoising_steps.to(torch.int32)
    frac = cur * steps.float().reciprocal() if cur.device.type == "cuda" else cur / steps
    return schedule.t_min + schedule.t_span * frac


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy over the last dim, computed as `torch.distributions.Categorical(logits=...)`
    does (normalise by logsumexp, clamp, -sum p log p), so it equals it bit for bit."""
    log_p = logits - logits.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(log_p, dim=-1)
    log_p = torch.clamp(log_p, min=torch.finfo(log_p.dtype).min)
    return -(log_p * probs).sum(-1)


def draw_initial_canvas(
    generators: Sequence[torch.Generator],
    canvas_length: int,
    vocab_size: int,
    device: torch.device | str,
) -> torch.Tensor:
    """`[R, L]` uniform random tokens, one `randint(0, V, (L,))` per request (the reference's
    `EntropyBoundSampler.initialize_canvas` at batch 1)."""
    rows = [
        torch.randint(0, vocab_size, (canvas_length,), generator=g, device=device)
        for g in generators
    ]
    if not rows:
        return torch.empty(0, canvas_length, dtype=torch.long, device=device)
    return torch.stack(rows)


def draw_step_noise(
    probs: torch.Tensor, generators: Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's random draws per request, in the reference's order: the candidate canvas
    `multinomial(probs[r], 1)` then the renoising tokens `randint(0, V, (L,))`. Returns
    (denoiser_canvas, random_canvas), both `[R, L]`."""
    num_requests, canvas_length, vocab_size = probs.shape
    if num_requests == 0:
        empty = torch.empty(0, canvas_length, dtype=torch.long, device=probs.device)
        return empty, empty.clone()
    sampled, noise = [], []
    for r in range(num_requests):
        g = generators[r]
        sampled.append(torch.multinomial(probs[r], num_samples=1, generator=g).squeeze(-1))
        noise.append(
            torch.randint(0, vocab_size, (canvas_length,), generator=g, device=probs.device)
        )
    return torch.stack(sampled), torch.stack(noise)


def acceptance_mask(
    entropy: torch.Tensor, probs: torch.Tensor, schedule: DenoiseSchedule
) -> torch.Tensor:
    """`[R, L]` bool: the positions that keep the candidate token.

    entropy_bound (reference): the k lowest-entropy positions with
    sum(entropy_1..k) - max(entropy_1..k) <= bound; always at least one.
    top_k: the k lowest-entropy positions (same sort, ties as `torch.sort`).
    confidence: positions whose largest processed probability is >= the threshold, plus the
    most confident position, so every step accepts at least one.
    """
    param = schedule.acceptance_param
    if schedule.acceptance == CONFIDENCE:
        confidence = probs.amax(dim=-1)
        mask = confidence >= param[:, None]
        return mask.scatter(-1, confidence.argmax(dim=-1, keepdim=True), True)
    sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False)
    if schedule.acceptance == TOP_K:
        ranks = torch.arange(entropy.shape[-1], device=entropy.device)
        selected = ranks[None, :] < param[:, None]
    else:
        cumulative = torch.cumsum(sorted_entropy, dim=-1)
        selected = cumulative - sorted_entropy <= param[:, None]
    return torch.scatter(torch.zeros_like(selected), dim=-1, index=order, src=selected)


def stopping_decision(
    argmax_canvas: torch.Tensor,
    entropy: torch.Tensor,
    state: StabilityState,
    schedule: DenoiseSchedule,
) -> tuple[torch.Tensor, torch.Tensor, StabilityState]:
    """(stable, confident, new state), each `[R]`: stable when the last
    `stability_threshold` argmax canvases equal this one (always when the threshold is 0),
    confident when the mean token entropy of the processed logits is below the threshold."""
    same = (argmax_canvas == state.prev_argmax).all(dim=-1)
    run = torch.where(same, state.stable_run + 1, torch.zeros_like(state.stable_run))
    stable = run >= schedule.stability_threshold
    confident = entropy.mean(dim=-1) < schedule.confidence_threshold
    return stable, confident, StabilityState(prev_argmax=argmax_canvas, stable_run=run)


def denoise_step_from_samples(
    processed_logits: torch.Tensor,
    probs: torch.Tensor,
    canvas: torch.Tensor,
    denoiser_canvas: torch.Tensor,
    random_canvas: torch.Tensor,
    step_index: torch.Tensor,
    schedule: DenoiseSchedule,
    state: StabilityState,
) -> DenoiseStepResult:
    """The deterministic part of a step, given its random draws (see `denoise_step`)."""
    entropy = token_entropy(processed_logits)
    accepted = acceptance_mask(entropy, probs, schedule)
    accepted_canvas = torch.where(accepted, denoiser_canvas, canvas)
    renoised = ~accepted
    argmax_canvas = torch.argmax(processed_logits, dim=-1)
    stable, confident, new_state = stopping_decision(argmax_canvas, entropy, state, schedule)
    stop_rule = stable & confident & schedule.adaptive_stopping
    exhausted = step_index + 1 >= schedule.max_denoising_steps
    return DenoiseStepResult(
        canvas=torch.where(renoised, random_canvas, accepted_canvas),
        accepted_canvas=accepted_canvas,
        accepted=accepted,
        renoised=renoised,
        argmax_canvas=argmax_canvas,
        processed_logits=processed_logits,
        stable=stable,
        confident=confident,
        stop_rule=stop_rule,
        exhausted=exhausted,
        commit=stop_rule | exhausted,
        stability=new_state,
    )


def denoise_step(
    logits: torch.Tensor,
    canvas: torch.Tensor,
    step_index: torch.Tensor,
    schedule: DenoiseSchedule,
    state: StabilityState,
    generators: Sequence[torch.Generator],
) -> DenoiseStepResult:
    """One denoising step for `R` requests.

    `logits [R, L, V]` float32 are the decoder's raw canvas logits for `canvas [R, L]` (the
    tokens the decoder saw), `step_index [R]` int64 the steps already done in each request's
    canvas, `state` from the previous step (`StabilityState.fresh` at a canvas start) and
    `generators[r]` request r's generator, consumed as `draw_step_noise` says. Pure: no
    argument is modified. Requests whose `commit` is True are done with this canvas; the
    others feed `canvas` and `processed_logits` to the next step.
    """
    temperature = step_temperature(schedule, step_index)
    processed = logits / temperature[:, None, None]
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    denoiser_canvas, random_canvas = draw_step_noise(probs, generators)
    return denoise_step_from_samples(
        processed, probs, canvas, denoiser_canvas, random_canvas, step_index, schedule, state
    )


def committed_length(
    argmax_canvas: torch.Tensor, eos_token_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_tokens [R], hit_eos [R]) for a committed canvas: the tokens up to and including
    the first EOS (the reference pads everything after it and finishes the sequence), or
    the whole canvas when it has no EOS. max_tokens / stop strings trim further (scheduler)."""
    canvas_length = argmax_canvas.shape[-1]
    if not eos_token_ids:
        full = torch.full(argmax_canvas.shape[:1], canvas_length, device=argmax_canvas.device)
        return full, torch.zeros_like(full, dtype=torch.bool)
    eos = torch.tensor(list(eos_token_ids), device=argmax_canvas.device)
    is_eos = torch.isin(argmax_canvas, eos)
    hit = is_eos.any(dim=-1)
    first = is_eos.to(torch.int8).argmax(dim=-1)
    return torch.where(hit, first + 1, torch.full_like(first, canvas_length)), hit
