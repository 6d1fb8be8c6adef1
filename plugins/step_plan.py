"""One step as the reference scheduler plans it, and the `SchedulerOutput` it becomes."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from tandem.core.request import Request
from tandem.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tandem.kv import KVCacheManager


@dataclass(slots=True, eq=False)
class StepPlan:
    """What one `schedule` call has decided so far.

    Invariants: `num_scheduled_tokens` holds exactly the requests of `scheduled_running`
    and `scheduled_new`, in the order they were scheduled; `token_budget` is the step's
    budget minus their tokens; `new_block_ids` has an entry for each scheduled RUNNING
    request; a request is in `preempted` and scheduled never both, but a `resent` one (its
    KV rolled back after a failed load) is scheduled as new and reported preempted: the
    worker drops its state and takes it anew from its valid prefix.
    """

    token_budget: int
    #: `speculative.num_speculative_tokens` (0 without a drafter).
    num_spec_tokens: int
    #: Ids some plugin is not ready for (`requests_not_ready`): not scheduled this step.
    not_ready: Collection[str]
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    resent: list[Request] = field(default_factory=list)

    def add_running(self, request: Request, num_tokens: int, block_ids: list[int]) -> None:
        """Schedule `num_tokens` of a RUNNING request with its new blocks. The tokens past
        its known ones (and past the placeholders of a step in flight) are drafts: those
        of `spec_token_ids` it verifies this step."""
        rid = request.request_id
        self.scheduled_running.append(request)
        self.num_scheduled_tokens[rid] = num_tokens
        self.new_block_ids[rid] = block_ids
        self.token_budget -= num_tokens
        if request.spec_token_ids:
            num_spec = (
                num_tokens
                + request.num_computed_tokens
                - request.num_tokens
                - request.num_output_placeholders
            )
            if num_spec > 0:
                self.spec_decode_tokens[rid] = request.spec_token_ids[:num_spec]

    def add_new(self, request: Request, num_tokens: int) -> None:
        """Schedule `num_tokens` of a request just admitted from WAITING."""
        self.scheduled_new.append(request)
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens

    def add_resent(self, request: Request, num_tokens: int) -> None:
        """Schedule `num_tokens` of a RUNNING request that the worker must take anew."""
        self.resent.append(request)
        self.add_new(request, num_tokens)

    def preempt(self, request: Request) -> None:
        """Record a preempted request; if it was scheduled earlier in this step, undo that
        and give its tokens back to the budget."""
        rid = request.request_id
        if rid in self.num_scheduled_tokens:
            if request in self.resent:
                self.resent.remove(request)
                self.scheduled_new.remove(request)
            else:
                self.scheduled_running.remove(request)
                self.new_block_ids.pop(rid)
            self.token_budget += self.num_scheduled_tokens.pop(rid)
            self.spec_decode_tokens.pop(rid, None)
        self.preempted.append(request)

    def to_output(
        self,
        step_id: int,
        kv_cache_manager: KVCacheManager,
        requests: Mapping[str, Request],
        finished_req_ids: set[str],
    ) -> SchedulerOutput:
        """The incremental `SchedulerOutput`: full data for new requests, block deltas for
        running ones. Reads ledgers as they are before `update_after_schedule`."""
        scheduled = self.num_scheduled_tokens
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=[
                NewRequestData(
                    req_id=r.request_id,
                    token_ids=list(r.all_token_ids),
                    num_prompt_tokens=r.num_prompt_tokens,
                    sampling_params=r.sampling_params,
                    block_ids=kv_cache_manager.get_block_ids(r.request_id),
                    num_computed_tokens=r.num_computed_tokens,
                    eos_token_id=r.eos_token_id,
                )
                for r in self.scheduled_new
            ],
            scheduled_cached_reqs=[
                CachedRequestData(
                    req_id=r.request_id,
                    new_block_ids=self.new_block_ids[r.request_id],
                    num_computed_tokens=r.num_computed_tokens,
                )
                for r in self.scheduled_running
            ],
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens=self.spec_decode_tokens,
            num_spec_tokens_to_schedule=self.num_spec_tokens,
            finished_req_ids=finished_req_ids,
            preempted_req_ids={r.request_id for r in (*self.preempted, *self.resent)},
            structured_output_request_ids=[
                rid for rid in scheduled if requests[rid].use_structured_output
            ],
        )
