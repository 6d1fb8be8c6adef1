"""What the worker returns for one step, and the sampler's result inside the worker.

Logprobs travel from the worker to the client as `TokenLogprobs`: one dict per position,
{token id: (logprob, rank)} with the sampled (or, for prompt logprobs, the actual prompt)
token first, then the top-N of that position (rank 1 = most likely). The output processor
turns them into vLLM's `Logprob` objects with decoded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from tandem.core.outputs import TokenLogprobs
from tandem.kv.connector import KVConnectorOutput


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
    that does not sample). `draft_token_ids` is the drafter's proposal for the next step of
    each request that sampled (None without a drafter), under both scheduling modes: the
    scheduler records it as `Request.draft_token_ids`; under synchronous scheduling it
    schedules those drafts, under async scheduling `-1` placeholders for which the worker
    substitutes this same proposal (`drafts_to_verify`).
    """

    req_ids: list[str] = field(default_factory=list)
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs] | None] | None = None
    draft_token_ids: dict[str, list[int]] | None = None
    #: Per request that verified drafts this step: how many of them it rejected. The
    #: scheduler rolls `num_computed_tokens` (and, under async scheduling, the output
    #: placeholders) back by exactly this delta; accepted = verified - rejected.
    num_rejected_drafts: dict[str, int] = field(default_factory=dict)
    #: Requests whose sampling failed this step, with the reason: the kernel ends each with
    #: `finish_reason == "error"` before `update_from_output` (their tokens are dummies).
    failed: dict[str, str] = field(default_factory=dict)
    #: Per request sampling its first token this step with `prompt_logprobs` set: one
    #: entry per prompt token after the first (vLLM's prompt logprobs without the leading
    #: None), computed over all its prefill chunks.
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None
    #: The KV connector's transfers and failed loads of this step (None: no connector).
    kv_connector_output: KVConnectorOutput | None = None


@runtime_checkable
class AsyncModelRunnerOutput(Protocol):
    """A step's output whose device-to-host copy may still be running.

    The worker may return one from `sample_tokens` instead of a `ModelRunnerOutput` (async
    scheduling without a drafter: `tandem.core.worker.async_output`). `get_output()` waits
    for the copy and returns the host result; the engine calls it only when it collects
    the step, so the worker is never blocked on the copy.
    """

    def get_output(self) -> ModelRunnerOutput: ...


def resolve_output(output: ModelRunnerOutput | AsyncModelRunnerOutput) -> ModelRunnerOutput:
    """The host-side result of a step, waiting for its device-to-host copy if needed."""
    return output if isinstance(output, ModelRunnerOutput) else output.get_output()
