"""An `HFStepModel` as drafters see it: a `DraftTarget` (see `core/worker/draft_context`).

One rank: the HF model's own embedding and rotary module, and the model's LM head (the
packed or panel linear the fused decoder path built; rows through `dense_weight`). Tensor
parallel: the fused decoder's vocabulary-parallel embedding (one all-reduce), the LM-head
shard's logits all-gathered and cut to the vocabulary, and LM-head rows gathered from the
shards that hold them (each row from exactly one rank, summed: bit for bit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.core.worker.draft_context import DraftTarget
from tandem.core.worker.parallel_state import tp_all_gather, tp_all_reduce

if TYPE_CHECKING:
    from tandem.models.hf_model import HFStepModel


def hf_draft_target(model: HFStepModel) -> DraftTarget:
    causal_lm = model.model
    inner = causal_lm.model
    head = model.lm_head
    if model.rank.tp_size == 1:
        embed = inner.embed_tokens
        logits = head
        lm_head_rows = lambda ids: head.dense_weight()[ids]  # noqa: E731
    else:
        embed = model.fused.embed
        logits = lambda hidden: _gathered_logits(model, hidden)  # noqa: E731
        lm_head_rows = lambda ids: _gathered_rows(model, ids)  # noqa: E731
    return DraftTarget(
        device=model.device,
        dtype=causal_lm.dtype,
        vocab_size=model.vocab_size,
        hf_config=causal_lm.config,
        embed=embed,
        rotary=inner.rotary_emb,
        logits=logits,
        lm_head_rows=lm_head_rows,
    )


def _gathered_logits(model: HFStepModel, hidden: torch.Tensor) -> torch.Tensor:
    """The whole vocabulary's logits from every rank's LM-head shard."""
    return tp_all_gather(model.lm_head(hidden).float())[:, : model.vocab_size]


def _gathered_rows(model: HFStepModel, ids: torch.Tensor) -> torch.Tensor:
    """LM-head weight rows of `ids`: each rank fills the rows its shard holds, zeros
    elsewhere; the all-reduce gives every rank every row exactly."""
    shard = model.lm_head.dense_weight()
    per = shard.shape[0]
    local = ids.to(shard.device) - model.rank.tp_rank * per
    inside = (local >= 0) & (local < per)
    rows = torch.zeros((ids.numel(), shard.shape[1]), dtype=shard.dtype, device=shard.device)
    rows[inside] = shard[local[inside]]
    return tp_all_reduce(rows)
