"""Rejection sampling of draft tokens: the emitted tokens are distributed exactly as the
target model's own samples would be, whatever the drafter proposed.

Layout (as the `sample` hook's): request r verifies `k_r` drafts with `k_r + 1` consecutive
rows, drafts first; row `start_r + j` (j < k_r) holds the target distribution p_j at draft
j's position and row `start_r + k_r` the bonus position's.

Per request, in order j = 0, 1, ...: accept draft d_j with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a token drawn from the residual
normalise(max(0, p_j - q_j)) and stop; when all k_r drafts are accepted, emit the bonus
token drawn from p_{k_r}. This is the standard speculative-sampling theorem: each emitted
token has the target's marginal, whatever q is.

A deterministic drafter has q_j = one-hot(d_j) (`draft_probs` None): accept with
probability p_j(d_j), on rejection emit a draw from p_j without d_j. This case is realised
by coupling with each row's own draw t_j ~ p_j (`target_token_ids`): accept iff t_j == d_j
(probability p_j(d_j)), on rejection emit t_j (given t_j != d_j it is distributed as p_j
without d_j). Same law, and the emitted tokens are then exactly those sampling without
drafts would give from the same randomness: a seeded request's output does not depend on
whether drafts were proposed. A greedy row's draw is its argmax, which gives "accept while
equal to the argmax, then the argmax".

Randomness is the caller's: the per-row draws, and for a drafter with probabilities one
acceptance uniform per row and one Gumbel noise row per row (the residual draw at draft
rows), independent of the draws. So a caller can derive all of them from (seed, output
position) and keep seeded requests reproducible in any batch. No Python loop over rows or
tokens.
"""

from __future__ import annotations

import torch


def draft_row_layout(
    num_draft_tokens: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first row of each request `[N]`, draft counts `[N]`, row of each draft `[D]`)."""
    counts = torch.tensor(num_draft_tokens, dtype=torch.int64, device=device)
    starts = torch.cumsum(counts + 1, 0) - (counts + 1)
    draft_rows = torch.repeat_interleave(starts, counts) + (
        torch.arange(int(counts.sum()), device=device)
        - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    )
    return starts, counts, draft_rows


def rejection_sample(
    target_token_ids: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    target_probs: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    accept_uniform: torch.Tensor | None = None,
    recovery_gumbel: torch.Tensor | None = None,
) -> torch.Tensor:
    """Verify drafts; return `[num_requests, 1 + max_k]` int64: the accepted drafts, then
    the recovered or bonus token, padded with -1.

    `target_token_ids` `[rows]`: a draw from each row's target distribution p (the
    argmax for greedy rows); the bonus rows' draws are the bonus tokens.
    `draft_token_ids` `[D]`: the drafts, flattened in request order. `draft_probs`
    `[D, V]`: the drafter's q at each draft, or None for a deterministic drafter. With
    `draft_probs` the caller also gives `target_probs` `[rows, V]` (p after every logits
    processor; rows sum to 1), `accept_uniform` `[rows]` in (0, 1) and `recovery_gumbel`
    `[rows, V]` standard Gumbel noise, independent of `target_token_ids`.
    """
    device = target_token_ids.device
    num_requests = len(num_draft_tokens)
    max_k = max(num_draft_tokens, default=0)
    if max_k == 0:
        return target_token_ids[:, None]
    starts, counts, draft_rows = draft_row_layout(num_draft_tokens, device)
    bonus = target_token_ids[starts + counts]
    out = torch.full((num_requests, max_k + 1), -1, dtype=torch.int64, device=device)
    drafts = draft_token_ids.to(device=device, dtype=torch.int64)
    if draft_probs is None:
        draws = target_token_ids[draft_rows]
        accepted = draws == drafts
        recovered = draws
    else:
        if target_probs is None or accept_uniform is None or recovery_gumbel is None:
            raise ValueError(
                "rejection_sample: draft_probs needs target_probs, accept_uniform and "
                "recovery_gumbel"
            )
        p = target_probs[draft_rows]  # [D, V]
        q = draft_probs.to(device=device, dtype=p.dtype)
        p_draft = p.gather(1, drafts[:, None]).squeeze(1)
        q_draft = q.gather(1, drafts[:, None]).squeeze(1)
        # u < p/q without dividing by q (q(d) = 0 means "accept iff p(d) > 0").
        accepted = accept_uniform[draft_rows] * q_draft < p_draft
        residual = (p - q).clamp_(min=0.0)
        # p <= q everywhere leaves no residual mass: then p == q, rejection has
        # probability 0; fall back to p.
        empty = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(empty, p, residual)
        recovered = (residual.log() + recovery_gumbel[draft_rows]).argmax(dim=1)
    # Per-request grids [N, max_k]: request r's draft j at column j.
    j = torch.arange(max_k, device=device)
    column = torch.arange(drafts.numel(), device=device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    request = torch.repeat_interleave(torch.arange(num_requests, device=device), counts)
    accept_grid = torch.zeros((num_requests, max_k), dtype=torch.bool, device=device)
    accept_grid[request, column] = accepted
    draft_grid = torch.full((num_requests, max_k), -1, dtype=torch.int64, device=device)
    draft_grid[request, column] = drafts
    recovered_grid = torch.full_like(draft_grid, -1)
    recovered_grid[request, column] = recovered
    num_accepted = accept_grid.to(torch.int64).cumprod(dim=1).sum(dim=1)  # leading accepts

    out[:, :max_k] = torch.where(j[None, :] < num_accepted[:, None], draft_grid, -1)
    # The token after the accepted drafts: recovered at the first rejection, else bonus.
    all_accepted = num_accepted == counts
    last = torch.where(
        all_accepted,
        bonus,
        recovered_grid.gather(1, num_accepted.clamp(max=max_k - 1)[:, None]).squeeze(1),
    )
    out.scatter_(1, num_accepted[:, None], last[:, None])
    return out
