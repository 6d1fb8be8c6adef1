"""The model interface of block-diffusion LLMs (DiffusionGemma, the scripted diffusion model).

A block-diffusion model generates `canvas_length` (L) tokens at a time. Two passes, both
batched over requests with different context lengths:

- `encode(batch)`: the causal encoder over a flattened `FlatBatch` of causal tokens (prompt
  chunks and committed canvases, exactly as an autoregressive model's prefill): it writes
  their KV at `batch.slot_mapping` through the paged cache and returns nothing. No logits:
  a diffusion model never samples from causal positions.
- `denoise(canvas_ids, self_cond, context)`: the bidirectional decoder over one canvas per
  request. Request r's L canvas tokens sit at positions `context.context_lens[r] ..
  context_lens[r] + L - 1`; its queries attend to its cached context (read through
  `context.block_tables[r]`, the first `context_lens[r]` tokens; a sliding-window layer sees
  only its window of them) and to the whole canvas, bidirectionally. It writes nothing to the
  cache (the canvas slots the scheduler reserved stay unwritten until the committed tokens
  are encoded). Returns raw float32 canvas logits `[R, L, V]` (after any final soft-cap).

Self-conditioning: `self_cond [R, L, V]` holds each request's previous step's processed
(temperature-scaled) logits, in the model's embedding dtype, or None when no row has any.
`context.has_self_cond[r]` False means row r is at its canvas's first step: the model uses
a zero soft embedding for it (as the reference does with `self_conditioning_logits=None`),
whatever `self_cond[r]` holds.

A model declares itself a block-diffusion model by implementing both methods and the
attribute `canvas_length` (`is_block_diffusion`); the model runner picks its diffusion path
once, at construction (`tandem.core.worker.diffusion_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from tandem.core.worker.flat_batch import FlatBatch


@dataclass(slots=True)
class DenoiseContext:
    """Where each request's cached context lives, for one `denoise` call (`R` requests).

    `block_tables [R, max_blocks]` int64: request r's blocks (padded with 0), the same
    layout `FlatBatch.block_tables` uses; `context_lens [R]` int64: tokens cached for
    request r (its canvas starts at that position); `has_self_cond [R]` bool: whether
    `self_cond[r]` is the previous step's logits (False: the canvas's first step). All on
    the model's device. `req_ids` is for diagnostics only.
    """

    req_ids: list[str]
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    has_self_cond: torch.Tensor
    block_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def canvas_positions(self, canvas_length: int) -> torch.Tensor:
        """`[R, L]` int64: each canvas token's position in its sequence."""
        offsets = torch.arange(canvas_length, dtype=torch.int64, device=self.context_lens.device)
        return self.context_lens[:, None] + offsets[None, :]


@runtime_checkable
class BlockDiffusionModel(Protocol):
    """A block-diffusion model on tandem's paged KV (see the module docstring)."""

    vocab_size: int
    device: torch.device
    #: The model's canvas length (the config's `canvas_length`): the default L.
    canvas_length: int

    def encode(self, batch: FlatBatch) -> None:
        """Write the KV of `batch`'s causal tokens at `batch.slot_mapping`; no logits."""
        ...

    def denoise(
        self,
        canvas_ids: torch.Tensor,
        self_cond: torch.Tensor | None,
        context: DenoiseContext,
    ) -> torch.Tensor:
        """Raw float32 canvas logits `[R, L, V]` for `canvas_ids [R, L]` int64, reading each
        request's cached context through `context`; writes nothing."""
        ...


def is_block_diffusion(model: object) -> bool:
    """Whether `model` implements `BlockDiffusionModel` (checked once, by the runner)."""
    return isinstance(model, BlockDiffusionModel)
