"""Outputs the client gets (vLLM's types): `Logprob`, `SampleLogprobs` (one {token id:
Logprob} per output token), `PromptLogprobs` (one per prompt token, the first None),
`CompletionOutput` and `RequestOutput`. The output processor builds them from the engine
core's `EngineCoreOutput`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log probability (vLLM's `Logprob`): `rank` is 1 for the most likely
    token; `decoded_token` is the token decoded alone (None when `detokenize` is False or
    there is no tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per output token: the sampled token and the top-N, {token id: Logprob}.
SampleLogprobs = list[dict[int, Logprob]]
#: Per prompt token: the prompt token and the top-N; None for the first token.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (vLLM's `CompletionOutput`).

    `logprobs` (when `SamplingParams.logprobs` is set) has one dict per token of
    `token_ids`; `cumulative_logprob` is the sum of the sampled tokens' logprobs then, else
    None. With `output_kind=DELTA` a streamed output holds only the new tokens, text and
    logprobs (`cumulative_logprob` stays the running total).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """Everything the client gets back for one prompt (vLLM's `RequestOutput`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = field(default=None)
    #: With `SamplingParams.prompt_logprobs`: one entry per prompt token, the first None.
    prompt_logprobs: PromptLogprobs | None = None
