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
from tandem.core.worker.logprobs import logprobs_per_request


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
