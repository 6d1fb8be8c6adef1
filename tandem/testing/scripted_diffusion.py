"""A deterministic block-diffusion model (`model: scripted-diffusion`) on the paged KV.

`encode` writes every causal token id into a paged int64 "KV cache" at its slot, as the AR
scripted model does. `denoise` reads each request's context back through its block table
and context length, so a wrong block table, slot mapping, prefix-cache hit or context
length changes the output. The committed canvas is known in closed form:

    S = sum((i + 1) * h_i) over the context h_0..h_{c-1}
    target[j] = ((S mod P) * A + (c + 1 + j) * B + j * C) mod P mod vocab,  j < L

(`scripted_canvas`); with a small vocabulary the EOS id lands inside some canvases.

Logits at canvas position j peak on `target[j]` at every step, so every argmax canvas is
the target and the committed tokens do not depend on the random draws. *Revealed*
positions peak at `REVEALED_LOGIT` (near-zero entropy), the others at `HIDDEN_LOGIT`
(entropy far above any confidence threshold). The number revealed is read from the
self-conditioning input, not from the (random) canvas: at a canvas's first step
(`has_self_cond` False) 1 position, then one more than the previous step's logits had
revealed (processed logit above `REVEAL_CUT`). With the stable-and-confident rule
(stability 1), a canvas of L' positions therefore commits after
`scripted_diffusion_steps(L', max_denoising_steps)` steps, whatever was drawn. The canvas
tokens only add a small ripple (< 1), so they are read but change no decision.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tandem.core.worker.block_diffusion import DenoiseContext
from tandem.core.worker.flat_batch import FlatBatch
from tandem.schema.config import EngineConfig
from tandem.schema.diffusion_config import DiffusionConfig
from tandem.schema.sampling_params import SamplingParams
from tandem.testing.scripted_loader import ScriptedModelLoader

_P = 1_000_003
_A = 7919
_B = 104_729
_C = 3571
REVEALED_LOGIT = 30.0
HIDDEN_LOGIT = 3.0
#: A processed (temperature-scaled) logit above this marks a revealed position.
REVEAL_CUT = 20.0


def scripted_canvas(context: list[int], canvas_length: int, vocab_size: int) -> list[int]:
    """The canvas the scripted diffusion model commits after `context`."""
    total = sum((i + 1) * t for i, t in enumerate(context)) % _P
    c = len(context)
    return [
        ((total * _A + (c + 1 + j) * _B + j * _C) % _P) % vocab_size for j in range(canvas_length)
    ]


def scripted_diffusion_steps(canvas_length: int, max_denoising_steps: int) -> int:
    """Denoising steps until a canvas of `canvas_length` commits (stability threshold 1):
    all positions revealed at step L-1, stable from step 1; or the step limit."""
    return min(max(canvas_length - 1, 1) + 1, max_denoising_steps)


def expected_scripted_diffusion_output(
    prompt_token_ids: list[int],
    params: SamplingParams,
    config: object,
) -> tuple[list[int], str]:
    """The committed tokens and finish reason the engine must give, in plain Python:
    canvases of min(L, max_model_len - len(context)), each trimmed after its first EOS
    (unless `ignore_eos`), then appended one at a time with `check_stop`'s rules.
    `config` is a resolved `EngineConfig` of the scripted diffusion model."""
    model = config.model  # type: ignore[attr-defined]
    canvas_length = config.diffusion.canvas_length  # type: ignore[attr-defined]
    vocab, eos, max_len = model.vocab_size, model.eos_token_id, model.max_model_len
    context, out = list(prompt_token_ids), []
    while True:
        canvas = scripted_canvas(context, min(canvas_length, max_len - len(context)), vocab)
        if not params.ignore_eos and eos in canvas:
            canvas = canvas[: canvas.index(eos) + 1]
        for token in canvas:
            context.append(token)
            out.append(token)
            if len(out) < params.min_tokens:
                if len(context) >= max_len:
                    return out, "length"
                continue
            if (not params.ignore_eos and token == eos) or token in params.stop_token_ids:
                return out, "stop"
            if len(context) >= max_len or len(out) >= params.max_tokens:
                return out, "length"


class ScriptedDiffusionModel:
    """`BlockDiffusionModel` of the scripted rule over a paged int64 cache."""

    def __init__(
        self,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        canvas_length: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.canvas_length = canvas_length
        self.device = torch.device(device)
        self.kv_cache = torch.full(
            (num_blocks * block_size,), -1, dtype=torch.int64, device=self.device
        )
        #: Calls, for tests and benchmarks: (encoded tokens, denoised rows).
        self.num_encoded_tokens = 0
        self.num_denoised_rows = 0

    def encode(self, batch: FlatBatch) -> None:
        self.kv_cache.index_copy_(0, batch.slot_mapping, batch.input_ids)
        self.num_encoded_tokens += batch.num_tokens

    def _context_sums(self, context: DenoiseContext) -> torch.Tensor:
        """`[R]` S mod P of each request's context, read back through its block table."""
        lengths = context.context_lens
        width = max(int(lengths.max()), 1)
        j = torch.arange(width, dtype=torch.int64, device=self.device)
        col = torch.clamp(j // self.block_size, max=context.block_tables.shape[1] - 1)
        slots = context.block_tables[:, col] * self.block_size + (j % self.block_size)[None, :]
        history = self.kv_cache[slots]
        valid = j[None, :] < lengths[:, None]
        if bool((valid & (history < 0)).any()):
            raise AssertionError(f"denoise read an unwritten KV slot for {context.req_ids}")
        return torch.where(valid, history * (j + 1)[None, :], 0).sum(dim=1) % _P

    def _revealed(
        self, self_cond: torch.Tensor | None, context: DenoiseContext, length: int
    ) -> torch.Tensor:
        """`[R]` positions revealed this step: 1 at a canvas's first step, else one more
        than the previous step's processed logits show."""
        if self_cond is None:
            return torch.ones(context.num_reqs, dtype=torch.int64, device=self.device)
        before = (self_cond.amax(dim=-1) > REVEAL_CUT).sum(dim=-1)
        count = torch.where(context.has_self_cond, before + 1, torch.ones_like(before))
        return torch.clamp(count, max=length)

    def denoise(
        self, canvas_ids: torch.Tensor, self_cond: torch.Tensor | None, context: DenoiseContext
    ) -> torch.Tensor:
        num_reqs, length = canvas_ids.shape
        self.num_denoised_rows += num_reqs
        c = context.context_lens
        j = torch.arange(length, dtype=torch.int64, device=self.device)
        target = (
            (self._context_sums(context)[:, None] * _A + (c[:, None] + 1 + j) * _B + j * _C) % _P
        ) % self.vocab_size
        vocab = torch.arange(self.vocab_size, dtype=torch.int64, device=self.device)
        ripple = ((target[..., None] * 131 + vocab * 71 + canvas_ids[..., None] * 17) % 97).to(
            torch.float32
        ) / 97.0
        revealed = j[None, :] < self._revealed(self_cond, context, length)[:, None]
        peak = torch.where(revealed, REVEALED_LOGIT, HIDDEN_LOGIT).to(torch.float32)
        return ripple.scatter(-1, target[..., None], peak[..., None])


#: The scripted diffusion model's own "generation config" (every `diffusion` field the
#: config leaves None): canvas 4, 8 steps, the reference's schedule and thresholds.
SCRIPTED_DIFFUSION_DEFAULTS = DiffusionConfig(
    canvas_length=4,
    max_denoising_steps=8,
    t_min=0.4,
    t_max=0.8,
    entropy_bound=0.1,
    stability_threshold=1,
    confidence_threshold=0.005,
    acceptance="entropy",
)


class ScriptedDiffusionLoader(ScriptedModelLoader):
    """`model: scripted-diffusion` (entry point in `tandem.model_loaders`): a
    block-diffusion model (`is_diffusion`) with the scripted model's limits (vocabulary
    128, EOS 1, max_model_len 1024 unless set); fills the `diffusion` section's defaults."""

    model_kinds: ClassVar[tuple[str, ...]] = ("scripted-diffusion",)
    is_diffusion: ClassVar[bool] = True

    @classmethod
    def resolve_limits(cls, config: EngineConfig) -> None:
        super().resolve_limits(config)
        if config.diffusion is None:
            config.diffusion = DiffusionConfig()
        config.diffusion.fill_defaults(SCRIPTED_DIFFUSION_DEFAULTS)

    @classmethod
    def load(cls, config: EngineConfig) -> ScriptedDiffusionModel:  # type: ignore[override]
        assert config.model.vocab_size is not None and config.cache.num_kv_blocks is not None
        assert config.diffusion is not None and config.diffusion.canvas_length is not None
        return ScriptedDiffusionModel(
            vocab_size=config.model.vocab_size,
            num_blocks=config.cache.num_kv_blocks,
            block_size=config.cache.block_size,
            canvas_length=config.diffusion.canvas_length,
        )
