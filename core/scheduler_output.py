"""The scheduler's plan for one step, sent to the worker.

It is incremental, as in vLLM V1: a request's prompt and sampling parameters cross to the
worker once (in `scheduled_new_reqs`, also when a preempted request resumes), and later
steps carry only deltas (new block ids, the scheduler's `num_computed_tokens`). Finished and
preempted ids tell the worker which cached state to drop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.schema.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has no state for: admitted for the first time or resumed.

    `token_ids` holds every known token (prompt, then confirmed outputs for a resumed
    request); `num_prompt_tokens` says where the prompt ends. `num_computed_tokens` counts
    the prefix-cache hit already present in `block_ids`. `input_error`, when set, says why
    this request's own data could not reach the worker (an executor could not send it);
    the worker then ends the request alone with that reason.
    """

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    input_error: str | None = None


@dataclass(slots=True)
class CachedRequestData:
    """A running request the worker already holds: only what changed since last step.

    `num_computed_tokens` is the scheduler's count when it planned the step, for observers
    (tracing, tests); the worker keeps its own count (advanced by what it executed, minus
    the drafts it rejected, which it reports as explicit deltas:
    `ModelRunnerOutput.num_rejected_drafts`). Under synchronous scheduling the two are
    equal. Under async scheduling the scheduler may plan a step before it has applied the
    deltas of the step in flight, so its count may exceed the worker's by them.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """What to run this step.

    `num_scheduled_tokens[req_id]` tokens of each request are computed, starting at the
    worker's count of its computed tokens (equal to `num_computed_tokens` as sent here,
    the value before this step's update, less the rejected drafts the scheduler has not
    applied yet: see `CachedRequestData`).
    Drafts to verify are in `scheduled_spec_decode_tokens` and are included in the count:
    real ids, or under async scheduling `-1` placeholders that the worker fills with its
    latest proposal (`drafts_to_verify`).
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
    #: The KV connector's transfer plan for this step (`build_connector_meta`), or None.
    kv_connector_metadata: Any = None


def drafts_to_verify(scheduled: list[int], proposal: Sequence[int]) -> list[int]:
    """The drafts the worker verifies for a request scheduled with `scheduled` drafts: the
    scheduled ids themselves, or where they are `-1` placeholders (async scheduling) the
    request's latest `proposal` (`Request.draft_token_ids`), cut to the scheduled count and
    padded with token 0. The worker and the grammar backends both use it, so a grammar's
    draft rows are the drafts verified. Padding never changes an output: a draft is
    accepted only when it equals the target's own token."""
    if not scheduled or scheduled[0] >= 0:
        return list(scheduled)
    drafts = list(proposal[: len(scheduled)])
    return drafts + [0] * (len(scheduled) - len(drafts))
