"""Logprobs in the worker: per-request rows from the sampler's tensors, and prompt
logprobs computed chunk by chunk during prefill (kept on the device until handed out).

Both travel to the engine as `TokenLogprobs`: {token id: (logprob, rank)}, the sampled (or
actual prompt) token first, then the top-N (rank 1 = most likely).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.outputs import TokenLogprobs


@dataclass(slots=True)
class PromptLogprobChunk:
    """Prompt logprobs of one prefill chunk, still as tensors (possibly on the device):
    per position the actual next prompt token, its logprob and rank, and the top-k."""

    token_ids: torch.Tensor  # [m] int64
    logprobs: torch.Tensor  # [m] float32
    ranks: torch.Tensor  # [m] int64
    top_ids: torch.Tensor  # [m, k] int64
    top_logprobs: torch.Tensor  # [m, k] float32

    def to_host(self) -> list[TokenLogprobs]:
        ids, lps, ranks = (t.tolist() for t in (self.token_ids, self.logprobs, self.ranks))
        top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        entries = []
        for i, token in enumerate(ids):
            entry = {token: (lps[i], ranks[i])}
            for rank, (tid, lp) in enumerate(zip(top_ids[i], top_lps[i], strict=True), 1):
                entry.setdefault(tid, (lp, rank))
            entries.append(entry)
        return entries


def prompt_logprob_chunk(logits: torch.Tensor, next_ids: list[int], k: int) -> PromptLogprobChunk:
    """Logprobs (of the raw model distribution) of `next_ids[i]` under `logits[i]`, with
    its rank and the top `k`; vectorised over the chunk's positions."""
    logprobs = logits.float().log_softmax(dim=1)
    target = torch.tensor(next_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, target[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top = logprobs.topk(k, dim=1)
    return PromptLogprobChunk(target, chosen[:, 0], ranks, top.indices, top.values)


def logprobs_per_request(
    num_reqs: int,
    sample_req_indices: list[int],
    num_draft_tokens: list[int],
    num_top_logprobs: list[int | None],
    sampled_rows: list[list[int]],
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> list[list[TokenLogprobs] | None]:
    """For each sampling request that asked (`num_top_logprobs` not None, one entry per
    sampling request): one {token: (logprob, rank)} per new token, the sampled token first,
    then the top-N of that position."""
    token_ids, values, ranks = (t.tolist() for t in logprobs)
    out: list[list[TokenLogprobs] | None] = [None] * num_reqs
    row = 0
    for r, k, num_top in zip(sample_req_indices, num_draft_tokens, num_top_logprobs, strict=True):
        if num_top is not None:
            entries = []
            for j in range(len(sampled_rows[r])):
                ids, lps = token_ids[row + j], values[row + j]
                entry = {ids[0]: (lps[0], ranks[row + j])}
                for rank, (tid, lp) in enumerate(
                    zip(ids[1 : 1 + num_top], lps[1 : 1 + num_top], strict=True), 1
                ):
                    entry.setdefault(tid, (lp, rank))
                entries.append(entry)
            out[r] = entries
        row += k + 1
    return out
