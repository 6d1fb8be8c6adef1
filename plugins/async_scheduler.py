"""The async layer: the only scheduling difference async scheduling makes.

Stacked right after the scheduler, it runs in `update_after_schedule` once the scheduler
has advanced `num_computed_tokens` and set `is_prefill_chunk`: every request that samples
this step gets `num_sampled_tokens_per_step + scheduled drafts` output placeholders, its
`spec_token_ids` become the shared read-only `[-1] * k` list (the worker verifies its
latest proposal in their place, which the scheduler records as `Request.draft_token_ids`),
and the step is marked `pending_structured_output_tokens` when a constrained
request still has unresolved placeholders; and the request may next be decoded
`scheduler.decode_stagger` steps later (`Request.next_decode_eligible_step`, default
`pipeline_parallel_size`: 1 step without pipeline parallelism). Everything else (the no-extra-step rule, the
stop estimate, resolving returned tokens, stale outputs) lives in the scheduler and is
inert while placeholders are 0.
"""

from __future__ import annotations

from pydantic import BaseModel

from tandem.core import hookimpl
from tandem.core.plugin_manager import PluginConfigError, TandemPlugin, TandemPluginManager
from tandem.core.scheduler_output import SchedulerOutput
from tandem.schema.config import EngineConfig


class AsyncScheduler(TandemPlugin):
    role = "async-layer"
    default_for_role = True

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        self._spec_token_placeholders: list[int] = [-1] * config.num_spec_tokens
        self._scheduler = None
        #: Steps between two decodes of one request: a token sampled on the last pipeline
        #: stage reaches the first stage `pp_size` steps later (the specification's
        #: `next_decode_eligible_step = current_step + decode_stagger`).
        self.decode_stagger = (
            config.scheduler.decode_stagger or config.parallel.pipeline_parallel_size
        )

    @hookimpl
    def tandem_stack_loaded(self, manager: TandemPluginManager) -> None:
        schedulers = manager.plugins_with_role("scheduler")
        if not schedulers or not hasattr(schedulers[0], "requests"):
            raise PluginConfigError(
                "async-scheduler: needs a scheduler plugin exposing `requests` and "
                "`num_sampled_tokens_per_step` before it in the stack"
            )
        self._scheduler = schedulers[0]

    @hookimpl
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        scheduler = self._scheduler
        assert scheduler is not None
        num_sampled = scheduler.num_sampled_tokens_per_step
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if len(self._spec_token_placeholders) != scheduler_output.num_spec_tokens_to_schedule:
            self._spec_token_placeholders = [-1] * scheduler_output.num_spec_tokens_to_schedule
        for request_id in scheduler_output.num_scheduled_tokens:
            request = scheduler.requests[request_id]
            if request.is_prefill_chunk:
                continue
            scheduler_output.pending_structured_output_tokens |= (
                request.use_structured_output and request.num_output_placeholders > 0
            )
            request.num_output_placeholders += num_sampled + len(spec_tokens.get(request_id, ()))
            request.spec_token_ids = self._spec_token_placeholders
            request.next_decode_eligible_step = scheduler_output.step_id + self.decode_stagger
