"""Per-row sampling parameters as tensors, so the sampler is vectorised over the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingMetadata:
    """Everything the `sample` hook needs besides the logits.

    All tensors have one entry per logits row. `temperature[i] == 0` is greedy (the runner
    stores 0 for every temperature below `SAMPLING_EPS`; the sampler also treats any row
    below it as greedy). `seeded[i]` says whether row i is seeded; its seed's 64 bits are
    `seeds[i]` as an int64 (a seed in [0, 2**64 - 1], two's complement), so every int64 is
    a valid seed. `seeded` None (hand-built metadata) means `seeds >= 0`, -1 unseeded.
    `output_positions[i]` is the index of the output token that row samples (with a seed,
    randomness comes from (seed, output position), so it does not depend on the batch).
    `top_k[i] <= 0` disables top-k. `output_token_ids[i]` is the row's output history, needed
    only by penalties and bad words (None when no row needs it). `num_draft_tokens[r]` is the
    number of drafts request r verifies; its `1 + num_draft_tokens[r]` rows are consecutive,
    drafts first, and `draft_token_ids` holds them flattened (empty without drafts).
    `request_row_ranges` maps request index to its slice of rows.
    """

    all_greedy: bool
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    output_positions: torch.Tensor
    num_draft_tokens: list[int]
    draft_token_ids: torch.Tensor
    #: Which rows use their seed (see above).
    seeded: torch.Tensor | None = None
    output_token_ids: list[list[int]] | None = None
    #: Each row's prompt: the repetition penalty covers prompt and output tokens.
    prompt_token_ids: list[list[int]] | None = None
    #: (presence, frequency, repetition) per row; set together with output_token_ids.
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    #: (rows, token ids) pairs forbidden this step: EOS and stop tokens before min_tokens,
    #: bad words whose prefix matches the row's history.
    blocked_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    #: (rows, token ids, biases): added to the raw logits before anything else.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    #: (rows, token ids): a row listed here may only sample its listed tokens.
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None = None
    grammar_bitmask: torch.Tensor | None = None
    max_num_logprobs: int | None = None
    #: The drafter's distribution q `[num_drafts, vocab]` at each draft (rows in
    #: `draft_token_ids` order), for exact rejection sampling; None for a deterministic
    #: drafter (q is one-hot at the draft).
    draft_probs: torch.Tensor | None = None
