"""What the engine core reports per request and step (engine side of the output path).

Logprobs travel inside the engine as compact `TokenLogprobs` dicts {token id: (logprob,
rank)}, the chosen token first; the front door's output processor turns them into vLLM's
`Logprob` objects (`tandem.schema.outputs`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: One position's logprobs inside the engine: {token id: (logprob, rank)}, the chosen
#: token first.
TokenLogprobs = dict[int, tuple[float, int]]


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step: new token ids and, when it ended, why."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprobs] | None = None
    #: Why the request failed, for `finish_reason == "error"`.
    error: str | None = None
    #: With the first output token of a request asking for `prompt_logprobs`: one entry per
    #: prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def ended(cls, request_id: str, reason: str, error: str | None = None) -> EngineCoreOutput:
        """A request that ended with no new token: aborted, failed, or stopped by a plugin."""
        return cls(request_id=request_id, new_token_ids=[], finish_reason=reason, error=error)


@dataclass(frozen=True, slots=True)
class PluginFinish:
    """A request a plugin ended on its own (`poll_finished_requests`): `finish_reason` is
    "error" (with `error`, the caller's message) or "stop"."""

    request_id: str
    finish_reason: str
    error: str | None = None
