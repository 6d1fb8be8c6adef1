"""Logprobs in the worker: per-request rows from the sampler's tensors, and prompt
logprobs computed chunk by chunk during prefill (kept on the device until handed out,
`PromptLogprobs`).

Both travel to the engine as `TokenLogprobs`: {token id: (logprob, rank)}, the sampled (or
actual prompt) token first, then the top-N (rank 1 = most likely).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.outputs import TokenLogprobs
from tandem.core.worker.flat_batch import FlatBatch


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


class PromptLogprobs:
    """Prompt logprobs of the requests asking for them, collected over their prefill chunks.

    A request is collected from its admission with no output token (a resumed request
    with outputs is not) until it samples its first token: each step adds the logits rows
    of its scheduled prompt positions to the forward (`extra_logits_rows`), the chunk is
    kept as tensors (`add_chunks`), and all of it goes to the host with the first sampled
    token (`take`).
    """

    def __init__(self) -> None:
        self.chunks: dict[str, list[PromptLogprobChunk]] = {}

    def admit(self, req_id: str, wanted: bool) -> None:
        self.chunks.pop(req_id, None)
        if wanted:
            self.chunks[req_id] = []

    def forget(self, req_id: str) -> None:
        self.chunks.pop(req_id, None)

    def extra_logits_rows(
        self, batch: FlatBatch, num_prompt_tokens: dict[str, int]
    ) -> tuple[list[tuple[str, int, int, int]], torch.Tensor | None]:
        """(req id, first scheduled position, first extra logits row, rows) per collected
        request of the step, and the flat token indices to add to `logits_indices`.
        Logits at position i score prompt token i + 1: positions up to P - 2."""
        if not self.chunks:
            return [], None
        wanted: list[tuple[str, int, int, int]] = []
        extra: list[torch.Tensor] = []
        first = batch.logits_indices.shape[0]
        offset = 0
        for req_id, start, n in zip(
            batch.req_ids, batch.num_computed_tokens, batch.num_scheduled_tokens, strict=True
        ):
            if req_id in self.chunks:
                count = max(min(start + n, num_prompt_tokens[req_id] - 1) - start, 0)
                if count:
                    wanted.append((req_id, start, first, count))
                    extra.append(torch.arange(offset, offset + count, dtype=torch.int64))
                    first += count
            offset += n
        return wanted, torch.cat(extra) if extra else None

    def add_chunks(
        self,
        logits: torch.Tensor,
        wanted: list[tuple[str, int, int, int]],
        next_ids: list[list[int]],
        num_top: list[int],
    ) -> None:
        """Keep each wanted request's chunk: `logits` rows `first..first+count` scored
        against `next_ids` (the prompt tokens after those positions), with its top-k."""
        for (req_id, _, first, count), ids, k in zip(wanted, next_ids, num_top, strict=True):
            self.chunks[req_id].append(prompt_logprob_chunk(logits[first : first + count], ids, k))

    def take(self, req_ids: list[str]) -> dict[str, list[TokenLogprobs]] | None:
        """The prompt logprobs of the collected requests among `req_ids` (those sampling
        their first token this step), on the host."""
        if not self.chunks:
            return None
        taken = {
            req_id: [entry for chunk in self.chunks.pop(req_id) for entry in chunk.to_host()]
            for req_id in req_ids
            if req_id in self.chunks
        }
        return taken or None
