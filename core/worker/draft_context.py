"""What the `propose_drafts` hook sees after a step was sampled."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.core.worker.flat_batch import FlatBatch


@dataclass(frozen=True, slots=True)
class DraftTarget:
    """The target model as a drafter reads it: sizes and four functions, never the live
    model (`StepModel.draft_target()` builds it; a model without one serves no model-based
    drafter).

    - `embed(ids [T])`: the target's token embeddings `[T, hidden]`;
    - `rotary(x [1, T, *], positions [1, T])`: the target's RoPE terms `(cos, sin)`;
    - `logits(hidden [N, hidden])`: the target's LM head over the whole vocabulary,
      `[N, vocab_size]`;
    - `lm_head_rows(ids [n])`: the LM head's weight rows of those token ids `[n, hidden]`.

    Under tensor parallelism `embed`, `logits` and `lm_head_rows` are collective (each rank
    holds a vocabulary shard): every rank calls them with the same arguments in the same
    order, which a drafter running identically on every rank does. `hf_config` is the
    target's transformers config, for its sizes only (hidden size, heads, head_dim).
    """

    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    hf_config: Any
    embed: Callable[[torch.Tensor], torch.Tensor]
    rotary: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    logits: Callable[[torch.Tensor], torch.Tensor]
    lm_head_rows: Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class DraftContext:
    """Inputs for a drafter, one entry per request of the step (in `batch` order).

    `token_ids[i]` is request i's full known history including the tokens sampled this
    step; `sampled_token_ids[i]` the tokens accepted this step: accepted drafts plus the
    sampled one, empty for a prefill chunk that did not sample (it gets no drafts, but a
    model-based drafter still sees its tokens, to build its own KV over the whole prompt).

    Model-based drafters also get the step itself:

    - `target`: the target model's `DraftTarget` (embedding, RoPE, LM head, sizes; None
      for a model that offers none);
    - `batch`: the step's `FlatBatch`; request i is `batch.req_ids[batch_index[i]]`, its
      rows are `batch.query_start_loc[batch_index[i]]` onwards, at positions from
      `num_computed_tokens[i]`;
    - `num_valid_tokens[i]`: how many of request i's scheduled rows are now history
      (scheduled tokens minus verified drafts plus accepted drafts); rows after them were
      rejected drafts. For a sampling request the valid rows end at position
      `len(token_ids[i]) - 2` (the bonus token is not computed yet);
    - `block_ids[i]`: request i's KV blocks (the target's; a drafter-owned pool of the same
      block layout may be indexed with them, and with `batch.slot_mapping`);
    - `hidden_states`: the target's last hidden states after the final norm, `[T, hidden]`
      for every flattened row of `batch`, only when the stack's drafter declares
      `needs_hidden_states = True` (no cost otherwise);
    - `finished_req_ids`: requests finished or preempted since the previous call; a
      drafter frees their state.
    """

    req_ids: list[str]
    token_ids: list[list[int]]
    sampled_token_ids: list[list[int]]
    num_spec_tokens: int
    hidden_states: torch.Tensor | None = None
    target: DraftTarget | None = None
    batch: FlatBatch | None = None
    batch_index: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_valid_tokens: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
