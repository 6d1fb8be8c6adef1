"""What the front end measures per batch of engine outputs, for stat loggers (metrics).

`RequestTimings` follows each request from arrival to its last token and turns one batch of
`EngineCoreOutput`s into an `IterationStats`: prompt tokens of requests that got their
first token, new output tokens, time to first token, inter-token latencies (time since the
request's previous tokens, vLLM's definition: one observation per batch that brought
tokens) and finished requests. Stat loggers receive it with the engine's own numbers
(`engine_stats`, see `core/hookspecs.py`) in `record`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.core.outputs import EngineCoreOutput


@dataclass(slots=True)
class FinishedRequestStats:
    finish_reason: str | None
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int | None = None
    n: int = 1


@dataclass(slots=True)
class IterationStats:
    """One batch of engine outputs as the front end processed it."""

    engine_index: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    """Receives the engine's numbers and the front end's per-batch measurements."""

    def record(
        self,
        engine_index: int,
        engine_stats: dict[str, Any] | None,
        iteration: IterationStats | None,
    ) -> None: ...


@dataclass(slots=True)
class _Timing:
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class RequestTimings:
    """Per-request clocks of the requests in flight (monotonic seconds)."""

    def __init__(self) -> None:
        self._timings: dict[str, _Timing] = {}

    def add(
        self, request_id: str, arrival_time: float, num_prompt_tokens: int, max_tokens: int | None
    ) -> None:
        self._timings[request_id] = _Timing(arrival_time, num_prompt_tokens, max_tokens)

    def discard(self, request_id: str) -> None:
        self._timings.pop(request_id, None)

    def observe(self, outputs: list[EngineCoreOutput], engine_index: int) -> IterationStats:
        now = time.monotonic()
        stats = IterationStats(engine_index=engine_index)
        for out in outputs:
            timing = self._timings.get(out.request_id)
            if timing is None:
                continue
            if out.new_token_ids:
                if timing.last_token_time is None:
                    stats.num_prompt_tokens += timing.num_prompt_tokens
                    stats.time_to_first_tokens_s.append(now - timing.arrival_time)
                else:
                    stats.inter_token_latencies_s.append(now - timing.last_token_time)
                timing.last_token_time = now
                timing.num_generation_tokens += len(out.new_token_ids)
                stats.num_generation_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                self.end(out.request_id, out.finish_reason, stats, now)
        return stats

    def end(
        self, request_id: str, reason: str, stats: IterationStats, now: float | None = None
    ) -> None:
        """Record a request that finished (in the engine, or in the front end: a stop
        string, a client abort) in `stats`; unknown or already ended ids are ignored."""
        timing = self._timings.pop(request_id, None)
        if timing is None:
            return
        now = time.monotonic() if now is None else now
        stats.finished.append(
            FinishedRequestStats(
                reason,
                now - timing.arrival_time,
                timing.num_prompt_tokens,
                timing.num_generation_tokens,
                timing.max_tokens,
            )
        )
