"""The reference scheduler: vLLM V1's scheduling rules as a tandem plugin.

Each step: RUNNING first, then WAITING (only in a step that preempted nothing). A request's
work is `num_tokens_with_spec + num_output_placeholders - num_computed_tokens`, clamped by
the token budget, `long_prefill_token_threshold` and `max_model_len`; chunked prefill is
just that clamp. A failed KV allocation preempts by recompute, possibly the request itself;
the victim frees its blocks through the fence, resets its ledger and goes back to WAITING.
The placeholder rules of async scheduling live here too and are inert while placeholders
are 0; the async layer only adds placeholders. Policy seams answered by plugins stacked
with it: the WAITING order (`make_waiting_queue`), the preemption victim
(`select_preemption_victim`) and readiness (`requests_not_ready`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from tandem.core import hookimpl
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.outputs import EngineCoreOutput
from tandem.core.plugin_manager import TandemPlugin, TandemPluginManager
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.scheduler_state import SchedulerState
from tandem.core.waiting_queue import WaitingQueue
from tandem.kv import KVBlock, KVCacheManager
from tandem.plugins.kv_connector_link import KVConnectorLink
from tandem.plugins.policy_hooks import PolicyHooks
from tandem.plugins.request_queue import make_queue
from tandem.plugins.scheduler_stats import SchedulerStats
from tandem.plugins.spec_metrics import SpecDecodeMetrics
from tandem.plugins.step_plan import StepPlan
from tandem.plugins.stop_check import append_output
from tandem.schema.config import EngineConfig


class ReferenceScheduler(TandemPlugin):
    """Owns the WAITING and RUNNING queues, the request registry and the KV cache manager."""

    role = "scheduler"
    default_for_role = True
    #: Tokens every decode step samples: 1 for autoregressive models, 0 for diffusion.
    num_sampled_tokens_per_step = 1

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        sched = config.scheduler
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_num_running_reqs = sched.max_num_seqs
        self.long_prefill_token_threshold = sched.long_prefill_token_threshold
        self.policy = sched.scheduling_policy
        self.max_model_len = config.max_model_len
        if config.cache.num_kv_blocks is None:
            raise ValueError("cache.num_kv_blocks must be resolved before the scheduler starts")
        self.kv_cache_manager = KVCacheManager(
            num_blocks=config.cache.num_kv_blocks,
            block_size=config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: WaitingQueue = make_queue(self.policy)  # or a plugin's: stack loaded
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.step_id = 0
        self.num_steps_in_flight = 0
        self.num_preemptions = 0
        self.spec_metrics = SpecDecodeMetrics(config.num_spec_tokens)
        self.stats = SchedulerStats()  # the `engine_stats` numbers
        spec = config.speculative
        self.spec_disable_by_batch_size = spec.disable_by_batch_size if spec else None
        #: The policy seams; without a plugin manager (unit tests): the defaults.
        self.policy_hooks = PolicyHooks(None, self.select_preemption_victim)
        self.kv_link = KVConnectorLink()  # the stack's KV connector: stack loaded

    # Policy seams -----------------------------------------------------------------------
    @hookimpl
    def tandem_stack_loaded(self, manager: TandemPluginManager) -> None:
        self.policy_hooks = PolicyHooks(manager.hook, self.select_preemption_victim)
        self.kv_link = KVConnectorLink(manager.hook)
        queue = self.policy_hooks.waiting_queue(self.config)
        if queue is not None:
            self.waiting = queue

    @hookimpl(trylast=True)
    def select_preemption_victim(self, running: Sequence[Request], needed_by: Request) -> Request:
        """FCFS: the most recently admitted; priority: the largest (priority, arrival)."""
        if self.policy == "priority":
            return max(running, key=lambda r: (r.priority, r.arrival_time))
        return running[-1]

    # Requests in and out --------------------------------------------------------------
    @hookimpl
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    @hookimpl
    def abort_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            was_running = request.status == RequestStatus.RUNNING
            request.status = status
            aborted.append(request)
            if not was_running:
                self.waiting.discard([request])
            self._release(request)
        if aborted:
            self.running = [r for r in self.running if not r.is_finished]

    @hookimpl
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or bool(self.running) or self.kv_link.holds_blocks

    @hookimpl
    def scheduler_state(self) -> SchedulerState:
        return SchedulerState(
            requests=self.requests,
            waiting=list(self.waiting),
            running=list(self.running),
            kv_cache_manager=self.kv_cache_manager,
            num_steps_in_flight=self.num_steps_in_flight,
        )

    @hookimpl
    def engine_stats(self) -> dict[str, object]:
        return self.stats.render(self)

    # Scheduling -----------------------------------------------------------------------
    def _num_new_tokens(self, request: Request, token_budget: int, num_computed: int) -> int:
        """The request's outstanding work, clamped by threshold, budget and max_model_len."""
        num_new = request.num_tokens_with_spec + request.num_output_placeholders - num_computed
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        num_new = min(num_new, token_budget)
        # The input position must not exceed the max model len.
        return min(num_new, self.max_model_len - num_computed - self.num_sampled_tokens_per_step)

    def _sits_out(self, request: Request) -> bool:
        """Async: the step in flight already reaches `max_tokens` even if every draft in
        flight is rejected (outputs: (computed + 1) - (placeholders - 1)): no extra step; or
        the step being planned is inside the request's decode stagger."""
        return self.step_id + 1 < request.next_decode_eligible_step or (
            request.num_output_placeholders > 0
            and request.num_computed_tokens + 2 - request.num_output_placeholders
            >= request.num_prompt_tokens + request.max_tokens
        )

    def _samples_last_output_token(self, request: Request) -> bool:
        """Whether the step being planned surely produces the request's last output token.

        Drafts may all be rejected, so count only outputs the request is sure to have after
        this step: the confirmed ones, one sampled by this step and, under async scheduling,
        one more from the step still in flight. Then nothing would verify drafts.
        """
        min_num_output_tokens = request.num_output_tokens + 1
        if request.num_output_placeholders > 0:
            min_num_output_tokens += 1
        return min_num_output_tokens >= request.max_tokens

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: free blocks (fenced), reset the ledger, requeue. Results
        of steps in flight for it become stale (`num_stale_output_tokens`: dropped)."""
        self.kv_cache_manager.free(request.request_id)
        self.kv_link.resend.discard(request.request_id)  # it comes back as new anyway
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_stale_output_tokens += request.num_in_flight_tokens
        request.num_in_flight_tokens = 0
        request.num_output_placeholders = 0
        request.is_prefill_chunk, request.next_decode_eligible_step = False, 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    @hookimpl
    def schedule(self) -> SchedulerOutput:
        self.waiting.advance(self.clock.now())
        not_ready = self.kv_link.not_ready(self.policy_hooks.not_ready())
        plan = StepPlan(self.max_num_batched_tokens, self.config.num_spec_tokens, not_ready)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        self.step_id += 1
        finished, self.finished_req_ids = self.finished_req_ids, set()
        output = plan.to_output(self.step_id, self.kv_cache_manager, self.requests, finished)
        return self.kv_link.with_metadata(output)

    def _schedule_running(self, plan: StepPlan) -> None:
        """RUNNING in order, each with its outstanding work within the budget; a request
        that cannot be fitted (or is not ready) is skipped, not the requests behind it."""
        # `speculative.disable_by_batch_size`: a large batch verifies no drafts this step.
        no_drafts = (
            self.spec_disable_by_batch_size is not None
            and len(self.running) > self.spec_disable_by_batch_size
        )
        req_index = 0
        while req_index < len(self.running) and plan.token_budget > 0:
            request = self.running[req_index]
            if request.request_id in plan.not_ready or self._sits_out(request):
                req_index += 1
                continue
            if request.spec_token_ids and (no_drafts or self._samples_last_output_token(request)):
                request.spec_token_ids = []
            num_new_tokens = self._num_new_tokens(
                request, plan.token_budget, request.num_computed_tokens
            )
            if num_new_tokens <= 0:
                req_index += 1
                continue
            blocks, req_index = self._allocate(plan, request, num_new_tokens, req_index)
            if blocks is None:
                if request.status != RequestStatus.RUNNING:
                    break  # the request preempted itself: nothing else can fit either
                req_index += 1
                continue
            if self.kv_link.take_resend(request.request_id):  # rolled back: worker anew
                plan.add_resent(request, num_new_tokens)
            else:
                plan.add_running(request, num_new_tokens, [b.block_id for b in blocks])
            req_index += 1

    def _allocate(
        self, plan: StepPlan, request: Request, num_new_tokens: int, req_index: int
    ) -> tuple[list[KVBlock] | None, int]:
        """KV for a RUNNING request, preempting victims until it fits: the new blocks (None:
        not this step) and `req_index` corrected for victims removed before it."""
        blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
        while blocks is None:
            if self.kv_cache_manager.fits_after_fences(request, num_new_tokens):
                # Blocks freed while a step is in flight return only at its fence:
                # preempting more cannot help this step. Wait for the fence.
                break
            victim = self.policy_hooks.victim(self.running, request)
            victim_index = self.running.index(victim)
            self.running.pop(victim_index)
            if victim_index < req_index:
                req_index -= 1
            plan.preempt(victim)
            self._preempt(victim)
            if victim is request:
                break
            blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
        return blocks, req_index

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit WAITING in queue order up to `max_num_seqs`; the first request that does
        not fit stops admission. A request not ready is skipped and put back in place."""
        skipped: list[Request] = []
        while (
            self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_running_reqs
        ):
            request = self.waiting.peek()
            if request.request_id in plan.not_ready:
                skipped.append(self.waiting.pop())
                continue
            kv = self.kv_cache_manager
            hit_blocks, num_hit_tokens = self.kv_link.admission_hit(request, kv)
            # tokens the KV connector loads past the local hit, now or (async) before admission
            bs = kv.block_size
            num_external, load_async = self.kv_link.external_tokens(request, num_hit_tokens, bs)
            if load_async:  # WAITING_FOR_REMOTE_KVS: its blocks now, admitted once loaded
                if not self.kv_link.start_load(request, kv, hit_blocks, num_external):
                    break  # out of KV: admission stops here
                skipped.append(self.waiting.pop())
                continue
            num_computed = num_hit_tokens + num_external
            num_new_tokens = self._num_new_tokens(request, plan.token_budget, num_computed)
            if num_new_tokens <= 0:
                break
            num_slots = num_new_tokens + num_external
            blocks = kv.allocate_slots(request, num_slots, num_hit_tokens, hit_blocks)
            if blocks is None:
                break  # out of KV: admission stops here
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            self.kv_link.after_alloc(request, kv, num_external)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                self.stats.observe_first_scheduled(request, self.clock.now())
            plan.add_new(request, num_new_tokens)
        for request in reversed(skipped):
            self.waiting.prepend(request)

    @hookimpl
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            request.num_in_flight_tokens += num_tokens
            request.is_prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders
            )
        if scheduler_output.total_num_scheduled_tokens > 0:
            self.kv_cache_manager.mark_step_scheduled()
            self.num_steps_in_flight += 1

    # Results ----------------------------------------------------------------------------
    def _append_output(self, request: Request, new_token_ids: list[int]) -> tuple[list[int], bool]:
        return append_output(request, new_token_ids, self.max_model_len)

    def _release(self, request: Request) -> None:
        """Forget a finished request: free its KV (fenced; or when the connector's save of
        it finishes) and report it to the worker."""
        self.kv_link.release(request, self.kv_cache_manager)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    @hookimpl
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        # Failed KV loads roll their requests back first: this step's outputs become stale.
        self.kv_link.fold_output(model_runner_output.kv_connector_output, self)
        # Proposals: recorded; scheduled as they are (sync) or as placeholders (async).
        drafts = model_runner_output.draft_token_ids
        schedule_drafts = not self.config.scheduler.async_scheduling
        for request_id in scheduler_output.preempted_req_ids:
            if request_id in self.requests:  # the worker dropped its proposal
                self.requests[request_id].draft_token_ids = []
        any_stopped = False
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # finished or aborted while this step was in flight
            is_stale = request.num_stale_output_tokens > 0
            if is_stale:
                request.num_stale_output_tokens -= num_tokens
                assert request.num_stale_output_tokens >= 0, request.ledger()
            else:
                request.num_in_flight_tokens -= num_tokens
            index = model_runner_output.req_id_to_index.get(request_id)
            generated = (
                list(model_runner_output.sampled_token_ids[index]) if index is not None else []
            )
            scheduled_spec = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            if scheduled_spec and generated:
                num_draft = len(scheduled_spec)  # rejected: the worker's delta (else inferred)
                fallback = num_draft - max(len(generated) - self.num_sampled_tokens_per_step, 0)
                num_rejected = model_runner_output.num_rejected_drafts.get(request_id, fallback)
                num_accepted = num_draft - num_rejected
                # Rejections roll back num_computed_tokens and the placeholders that covered
                # the drafts; a stale count predates the preemption rollback.
                if not is_stale:
                    if request.num_computed_tokens > 0:
                        request.num_computed_tokens -= num_rejected
                    if request.num_output_placeholders > 0:
                        request.num_output_placeholders -= num_rejected
                    self.spec_metrics.observe(num_draft, num_accepted)
            if is_stale or not generated:
                continue
            new_token_ids, stopped = self._append_output(request, generated)
            if drafts is not None and not stopped:
                request.draft_token_ids = drafts.get(request_id, [])
                if schedule_drafts:
                    request.spec_token_ids = request.draft_token_ids
            new_logprobs = None
            if model_runner_output.logprobs is not None and index is not None:
                row_logprobs = model_runner_output.logprobs[index]
                new_logprobs = row_logprobs[: len(new_token_ids)] if row_logprobs else None
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=new_logprobs,
                    prompt_logprobs=(model_runner_output.prompt_logprobs or {}).get(request_id),
                    finish_reason=request.status.finish_reason if stopped else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )
            if stopped:
                any_stopped = True
                self._release(request)
        self._end_update(scheduler_output, any_stopped)
        return outputs

    def _end_update(self, scheduler_output: SchedulerOutput, any_stopped: bool) -> None:
        """A step's results are in: drop stopped requests from RUNNING, retire the step."""
        if any_stopped:
            self.running = [r for r in self.running if not r.is_finished]
        if scheduler_output.total_num_scheduled_tokens > 0:
            self.num_steps_in_flight -= 1
            self.kv_cache_manager.mark_step_processed()
