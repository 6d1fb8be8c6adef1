"""What the worker returns for one step, and the sampler's result inside the worker."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplerOutput:
    """Result of the `sample` hook.

    `sampled_token_ids` is `[num_rows, 1 + max_drafts]` int64 on the logits' device; a row's
    accepted tokens come first, then `-1` padding. A row that rejects every draft still
    holds one token (the target's correction); with no drafts every row holds one token.
    `logprobs` (optional) is `(token_ids [num_rows, 1 + N], logprobs [num_rows, 1 + N],
    ranks [num_rows])` for the sampled token followed by the top-N.
    """

    sampled_token_ids: torch.Tensor
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per-request results of one step, on the host.

    `sampled_token_ids[i]` are the new tokens of `req_ids[i]` (empty for a prefill chunk
    that does not sample). `draft_token_ids` carries the drafts proposed for the next step
    under synchronous scheduling (under async they stay in the worker).
    """

    req_ids: list[str] = field(default_factory=list)
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict[int, tuple[float, int]]] | None] | None = None
    draft_token_ids: dict[str, list[int]] | None = None
