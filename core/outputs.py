"""Outputs crossing from the engine to the client."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's news from one step: new token ids and, when it ended, why."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[dict[int, tuple[float, int]]] | None = None
    #: Why the request failed, for `finish_reason == "error"`.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class PluginFinish:
    """A request a plugin ended on its own (`poll_finished_requests`): `finish_reason` is
    "error" (with `error`, the caller's message) or "stop"."""

    request_id: str
    finish_reason: str
    error: str | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (vLLM's `CompletionOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, tuple[float, int]]] | None = None

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
