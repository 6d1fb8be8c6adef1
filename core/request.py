"""The request and its ledger: the vocabulary every part of the engine speaks.

Counters (all in tokens), following vLLM V1:

- `num_prompt_tokens`: prompt length, fixed at creation.
- `num_output_tokens`: output tokens confirmed on the CPU (seen by clients and stop checks).
- `num_tokens`: prompt + confirmed outputs ("known" tokens).
- `num_computed_tokens`: tokens already *scheduled* into a forward pass (counted
  optimistically at schedule time, so KV for them exists or is being written).
- `spec_token_ids`: draft tokens to verify in the next step; `num_tokens_with_spec` adds them.
- `num_output_placeholders`: output slots reserved by async scheduling whose ids have not
  come back yet (always 0 under synchronous scheduling).
- `num_in_flight_tokens`: tokens scheduled whose results have not been processed.
- `num_stale_output_tokens`: in-flight tokens scheduled before a preemption; their results
  are ignored when they arrive.
- `is_prefill_chunk`: after scheduling, the step will not sample this request.

The scheduler's work is `num_tokens_with_spec + num_output_placeholders - num_computed_tokens`.
Invariants: `num_output_placeholders >= 0`, `num_computed_tokens - num_output_placeholders
>= 0`, `num_stale_output_tokens >= 0`, `num_in_flight_tokens >= 0`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.core.clock import WALL_CLOCK
from tandem.schema.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_REMOTE_KVS = 3  # in WAITING, its blocks loading from a KV connector
    # Everything at or above FINISHED_STOPPED is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. Created by the kernel, owned by the scheduler plugin."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=WALL_CLOCK.now)
    priority: int = 0

    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)  # the worker's latest proposal
    num_output_placeholders: int = 0
    num_in_flight_tokens: int = 0
    num_stale_output_tokens: int = 0
    is_prefill_chunk: bool = False
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    use_structured_output: bool = False
    #: The first step id (`SchedulerOutput.step_id`) at which the request may be scheduled
    #: for decode again: set by the async layer to the step it was scheduled in +
    #: `scheduler.decode_stagger` (pipeline microbatching), 0 = any step.
    next_decode_eligible_step: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.structured_outputs is not None:
            self.use_structured_output = True

    # Derived counters ------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def safe_frontier(self) -> int:
        """KV length that depends on no in-flight result: `num_computed_tokens` minus the
        output placeholders it already counts. Always >= 0 (an invariant); a request that
        is stopped and resumed must restart from here, never from `num_computed_tokens`."""
        return self.num_computed_tokens - self.num_output_placeholders

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def ledger(self) -> dict[str, object]:
        """A snapshot of every counter, for error messages and ledger dumps."""
        return {
            "request_id": self.request_id,
            "status": self.status.name,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_tokens": self.num_tokens,
            "num_computed_tokens": self.num_computed_tokens,
            "num_spec_tokens": len(self.spec_token_ids),
            "num_output_placeholders": self.num_output_placeholders,
            "num_in_flight_tokens": self.num_in_flight_tokens,
            "num_stale_output_tokens": self.num_stale_output_tokens,
            "is_prefill_chunk": self.is_prefill_chunk,
            "num_preemptions": self.num_preemptions,
        }
