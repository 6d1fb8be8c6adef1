"""Canvas steps without a model: the diffusion runner's answer to a step, reduced to counting.

A simulated block-diffusion device (`virtual_device.py`) needs to know only *which*
requests commit a canvas in a step and how many tokens, not the token values.
`DiffusionTokenOracle` follows the diffusion runner's rules
(`core/worker/diffusion_runner.py`, `plugins/diffusion_scheduler.py`): a request's
scheduled tokens are its causal tokens (prompt chunk or last commit) followed by, when
`scheduled_spec_decode_tokens` has it, its canvas of L' positions; each such step is one
denoising step of that canvas; at the canvas's last step the request commits all L'
positions (simulated requests ignore EOS, so nothing is trimmed: the scheduler trims at
`max_tokens`). A request that is new to the worker (admitted, or resumed after a
preemption) starts its canvas over, as the runner drops its `CanvasState`.

The denoising model: every step fixes `tokens_per_step` more canvas positions (the
positions the acceptance rule takes with confidence), and the stable-and-confident rule
commits at the first step where all L' positions are fixed and the argmax canvas has been
the same for `stability_threshold` steps; the step limit `max_denoising_steps` commits
regardless. Steps per canvas:

    tokens_per_step None:  max_denoising_steps (adaptive stopping never fires)
    tokens_per_step k:     min(max(ceil(L' / k), stability_threshold + 1), max_denoising_steps)

The scripted diffusion model (`tandem.testing.scripted_diffusion`) reveals one position per
step with stability 1, so k = 1 reproduces it exactly (`scripted_diffusion_steps`).
Committed token ids are a fixed non-EOS id. Invariant: `steps_done[r] <
steps_per_canvas(L')` for every live request r between steps.
"""

from __future__ import annotations

from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.scheduler_output import SchedulerOutput


class DiffusionTokenOracle:
    """Per-request denoising steps done in the current canvas; `step` turns a scheduler
    output into the diffusion runner's answer (module docstring)."""

    def __init__(
        self,
        max_denoising_steps: int,
        stability_threshold: int = 1,
        tokens_per_step: int | None = None,
        token_id: int = 2,
    ) -> None:
        if max_denoising_steps < 1:
            raise ValueError(
                f"diffusion.max_denoising_steps: expected >= 1, got {max_denoising_steps}"
            )
        if stability_threshold < 0:
            raise ValueError(
                f"diffusion.stability_threshold: expected >= 0, got {stability_threshold}"
            )
        if tokens_per_step is not None and tokens_per_step < 1:
            raise ValueError(
                f"denoise_tokens_per_step: expected >= 1 (or None), got {tokens_per_step}"
            )
        self.max_denoising_steps = max_denoising_steps
        self.stability_threshold = stability_threshold
        self.tokens_per_step = tokens_per_step
        self.token_id = token_id
        self.steps_done: dict[str, int] = {}

    def steps_per_canvas(self, canvas_length: int) -> int:
        """Denoising steps until a canvas of `canvas_length` positions commits."""
        k = self.tokens_per_step
        if k is None:
            return self.max_denoising_steps
        needed = max(-(-canvas_length // k), self.stability_threshold + 1)
        return min(needed, self.max_denoising_steps)

    def step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply one step in step order (as the runner executes them)."""
        steps = self.steps_done
        for rid in (*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids):
            steps.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            steps[new.req_id] = 0  # a fresh canvas state, as the runner's `admit`
        canvases = scheduler_output.scheduled_spec_decode_tokens
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            length = len(canvases.get(rid, ()))
            committed: list[int] = []
            if length:
                done = steps.get(rid, 0) + 1
                if done >= self.steps_per_canvas(length):
                    committed, done = [self.token_id] * length, 0
                steps[rid] = done
            sampled.append(committed)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
