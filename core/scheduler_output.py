"""The scheduler's plan for one step, sent to the worker.

It is incremental, as in vLLM V1: a request's prompt and sampling parameters cross to the
worker once (in `scheduled_new_reqs`, also when a preempted request resumes), and later
steps carry only deltas (new block ids, the scheduler's `num_computed_tokens`). Finished and
preempted ids tell the worker which cached state to drop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has no state for: admitted for the first time or resumed.

    `token_ids` holds every known token (prompt, then confirmed outputs for a resumed
    request); `num_prompt_tokens` says where the prompt ends. `num_computed_tokens` counts
    the prefix-cache hit already present in `block_ids`.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None


@dataclass(slots=True)
class CachedRequestData:
    """A running request the worker already holds: only what changed since last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """What to run this step.

    `num_scheduled_tokens[req_id]` tokens of each request are computed, starting at the
    request's `num_computed_tokens` as sent here (the value before this step's update).
    Drafts to verify are in `scheduled_spec_decode_tokens` and are included in the count.
    `pending_structured_output_tokens` asks the kernel to defer sampling one step.
    """

    step_id: int
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_spec_tokens_to_schedule: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    pending_structured_output_tokens: bool = False
    structured_output_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
