"""What the worker returns for one step, and the sampler's result inside the worker.

Logprobs travel from the worker to the client as `TokenLogprobs`: one dict per position,
{token id: (logprob, rank)} with the sampled (or, for prompt logprobs, the actual prompt)
token first, then the top-N of that position (rank 1 = most likely). The output processor
turns them into vLLM's `Logprob` objects with decoded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.core.outputs import TokenLogprobs


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
    under synchronous scheduling; the scheduler schedules them. Under async scheduling the
    scheduler keeps `-1` placeholders and `draft_token_ids` is None; `kept_draft_token_ids`
    then reports, for information only, the drafts the worker will substitute for those
    placeholders in the next step (a grammar backend needs them for its draft rows).
    """

    req_ids: list[str] = field(default_factory=list)
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs] | None] | None = None
    draft_token_ids: dict[str, list[int]] | None = None
    kept_draft_token_ids: dict[str, list[int]] | None = None
    #: Requests whose sampling failed this step, with the reason: the kernel ends each with
    #: `finish_reason == "error"` before `update_from_output` (their tokens are dummies).
    failed: dict[str, str] = field(default_factory=dict)
    #: Per request sampling its first token this step with `prompt_logprobs` set: one
    #: entry per prompt token after the first (vLLM's prompt logprobs without the leading
    #: None), computed over all its prefill chunks.
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None


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


@dataclass(slots=True)
class AsyncModelRunnerOutput:
    """One step's results under async scheduling, before the device-to-host copy is waited on.

    The worker returns it from `sample_tokens` right after starting the copy of the sampled
    ids (and logprobs) to host memory (on CUDA: on a separate copy stream, `copy_done`
    recorded after it). `get_output()` waits for that copy and builds the
    `ModelRunnerOutput`; the engine calls it when it collects the step, so the worker never
    blocks on the copy before running the next step. Host tensors are never reused, so
    nothing can overwrite them before `get_output()` reads them.
    """

    req_ids: list[str]
    sample_req_indices: list[int]
    num_top_logprobs: list[int | None]
    sampled_token_ids: torch.Tensor  # host [num_sampling_requests, 1], possibly in flight
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    copy_done: torch.cuda.Event | None = None
    failed: dict[str, str] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self.copy_done is not None:
            self.copy_done.synchronize()
        sampled_rows: list[list[int]] = [[] for _ in self.req_ids]
        for r, token in zip(
            self.sample_req_indices, self.sampled_token_ids[:, 0].tolist(), strict=True
        ):
            sampled_rows[r] = [token]
        logprobs = None
        if self.logprobs is not None:
            logprobs = logprobs_per_request(
                len(self.req_ids),
                self.sample_req_indices,
                [0] * len(self.sample_req_indices),
                self.num_top_logprobs,
                sampled_rows,
                self.logprobs,
            )
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            req_id_to_index={r: i for i, r in enumerate(self.req_ids)},
            sampled_token_ids=sampled_rows,
            logprobs=logprobs,
            failed=self.failed,
            prompt_logprobs=self.prompt_logprobs,
        )


def resolve_output(output: ModelRunnerOutput | AsyncModelRunnerOutput) -> ModelRunnerOutput:
    """The host-side result of a step, waiting for its device-to-host copy if needed."""
    return output.get_output() if isinstance(output, AsyncModelRunnerOutput) else output
