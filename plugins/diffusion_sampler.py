"""The denoising sampler: DiffusionGemma's step (`diffusion_denoise.denoise_step`) on the
`sample` hook, for the diffusion runner path (`core/worker/diffusion_runner.py`).

On a denoising step the runner calls `sample(logits=[R, L, V] raw canvas logits,
metadata=DenoiseMetadata)`, and before a canvas's
first step `sample(logits=<empty>, metadata=InitialCanvasMetadata)` for its initial random
tokens (every draw is this plugin's); this plugin applies the linear temperature schedule, draws
with one generator per request keyed by (seed, canvas index, step) (`step_generators`), so
a restart after preemption, async scheduling and any batch composition repeat the same
draws, picks the accepted positions (`diffusion.acceptance`: entropy bound as the
reference, confidence threshold or top-k per step; this plugin's options may override it),
renoises the rest and evaluates the stable-and-confident stopping rule. A row that commits
returns its argmax canvas trimmed after the first EOS (`committed_length`). With any other
metadata it answers None (it is no autoregressive sampler).

Schedule parameters come from the resolved `diffusion` section (same for every request).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from tandem.core import hookimpl
from tandem.core.plugin_manager import PluginConfigError, TandemPlugin
from tandem.core.worker.diffusion_state import (
    DenoiseMetadata,
    DenoiseSamplerOutput,
    InitialCanvasMetadata,
)
from tandem.plugins.diffusion_denoise import (
    CONFIDENCE,
    ENTROPY_BOUND,
    TOP_K,
    DenoiseSchedule,
    StabilityState,
    committed_length,
    denoise_step,
    draw_initial_canvas,
    step_generators,
)
from tandem.schema.config import EngineConfig

_RULES = {"entropy": ENTROPY_BOUND, "confidence": CONFIDENCE, "top_k": TOP_K}


class DiffusionSampler(TandemPlugin):
    """Worker-side denoising sampler (see the module docstring)."""

    role = "sampler"
    default_for_role = False
    #: The default of its role for block-diffusion models (`config_resolution`).
    diffusion_default = True

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        acceptance: Literal["entropy", "confidence", "top_k"] | None = None
        top_k: int | None = None
        #: The "confidence" rule's minimum probability of a position's best token.
        confidence: float = 0.9

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        diffusion = getattr(config, "diffusion", None)
        if diffusion is None or diffusion.max_denoising_steps is None:
            raise PluginConfigError(
                "diffusion-sampler: needs a diffusion model (a resolved `diffusion` section)"
            )
        self.diffusion = diffusion
        opts = options if isinstance(options, DiffusionSampler.Options) else self.Options()
        self.acceptance = _RULES[opts.acceptance or diffusion.acceptance or "entropy"]
        top_k = opts.top_k if opts.top_k is not None else diffusion.top_k
        if self.acceptance == TOP_K and top_k is None:
            raise PluginConfigError("diffusion.top_k: required with acceptance 'top_k'")
        self.acceptance_param: float = {
            ENTROPY_BOUND: diffusion.entropy_bound,
            CONFIDENCE: opts.confidence,
            TOP_K: top_k,
        }[self.acceptance]
        self._schedules: dict[tuple[int, str], DenoiseSchedule] = {}

    def schedule_for(self, num_reqs: int, device: torch.device) -> DenoiseSchedule:
        """The (cached) schedule of `num_reqs` rows, identical per row."""
        key = (num_reqs, str(device))
        if key not in self._schedules:
            d = self.diffusion
            self._schedules[key] = DenoiseSchedule.build(
                max_denoising_steps=[d.max_denoising_steps] * num_reqs,
                t_min=[d.t_min] * num_reqs,
                t_max=[d.t_max] * num_reqs,
                stability_threshold=[d.stability_threshold] * num_reqs,
                confidence_threshold=[d.confidence_threshold] * num_reqs,
                acceptance_param=[self.acceptance_param] * num_reqs,
                acceptance=self.acceptance,
                device=device,
            )
        return self._schedules[key]

    @staticmethod
    def initial_canvases(metadata: InitialCanvasMetadata, device: torch.device) -> torch.Tensor:
        """`[R, L]` uniform random tokens, each row from its generator keyed (seed, canvas
        index, -1): the reference's `initialize_canvas` draw at batch 1."""
        steps = [-1] * len(metadata.seeds)
        generators = step_generators(metadata.seeds, metadata.canvas_indices, steps, device)
        return draw_initial_canvas(generators, metadata.canvas_length, metadata.vocab_size, device)

    @hookimpl
    def sample(
        self, logits: torch.Tensor, metadata: object
    ) -> DenoiseSamplerOutput | torch.Tensor | None:
        if isinstance(metadata, InitialCanvasMetadata):
            return self.initial_canvases(metadata, logits.device)
        if not isinstance(metadata, DenoiseMetadata):
            return None
        device = logits.device
        steps = metadata.step_index
        generators = step_generators(
            metadata.seeds, metadata.canvas_indices, steps.tolist(), device
        )
        state = StabilityState(prev_argmax=metadata.prev_argmax, stable_run=metadata.stable_run)
        result = denoise_step(
            logits,
            metadata.canvas,
            steps,
            self.schedule_for(len(metadata.req_ids), device),
            state,
            generators,
        )
        committed: list[list[int]] = [[] for _ in metadata.req_ids]
        for r in torch.nonzero(result.commit).flatten().tolist():
            row = result.argmax_canvas[r : r + 1]
            length, _ = committed_length(row, metadata.eos_token_ids[r])
            committed[r] = row[0, : int(length[0])].tolist()
        return DenoiseSamplerOutput(
            canvas=result.canvas,
            processed_logits=result.processed_logits,
            argmax_canvas=result.argmax_canvas,
            stable_run=result.stability.stable_run,
            commit=result.commit,
            committed=committed,
        )
