"""What the `propose_drafts` hook sees after a step was sampled."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DraftContext:
    """Inputs for a drafter.

    `token_ids[i]` is request i's full known history including the tokens sampled this
    step; `sampled_token_ids[i]` the tokens accepted this step (empty for a prefill chunk,
    which gets no drafts). `hidden_states` is the target's last hidden state at each
    request's last accepted position, when the runner provides it.
    """

    req_ids: list[str]
    token_ids: list[list[int]]
    sampled_token_ids: list[list[int]]
    num_spec_tokens: int
    hidden_states: torch.Tensor | None = None
