"""`lrw-victim`: preempt the running request with the Longest Remaining Work.

A policy plugin stacked with `reference-scheduler`: it answers one hook,
`select_preemption_victim`. When the scheduler runs out of KV blocks for a RUNNING request
it preempts (by recompute) a victim chosen here instead of the most recently admitted one.
Everything else is the reference scheduler's, so every request produces exactly the tokens
it would without the plugin; only which request loses its KV (and so latency) changes.

    plugins: [reference-scheduler, {name: lrw-victim, options: {max_preemptions: 2}},
              default-sampler]

Policy. The remaining work of a running request R is

    work(R) = min(max_tokens - num_output_tokens, max_model_len - num_tokens)
              + max(num_prompt_tokens - num_computed_tokens, 0)

(outputs still to decode, plus prompt tokens not computed yet). The victim is the candidate
with the largest `work`: it would hold its blocks the longest, so freeing them helps the
most requests finish; short requests near their end keep their KV. Ties go to the most
recently admitted (the reference FCFS choice). Under `scheduling_policy: priority` only the
candidates of the least important priority (the largest value) are considered, as the
reference scheduler does.

Starvation bound. A request already preempted `max_preemptions` times is not a candidate
while any RUNNING request preempted fewer times is: then it is never chosen. So a long
request loses its progress at most `max_preemptions` times to fresher requests; it can be
preempted again only in a step where every running request has reached the bound (then the
plugin falls back to all of them, longest work first). Without the bound (a very large
`max_preemptions`) a long request that keeps being admitted and preempted behind a stream
of short ones could be recomputed without end.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field
from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin
from tandem.core.request import Request
from tandem.schema.config import EngineConfig

__all__ = ["LRWOptions", "LRWVictim", "remaining_work"]


def remaining_work(request: Request, max_model_len: int) -> int:
    """Outputs still to decode (capped by the room under `max_model_len`) plus prompt
    tokens not computed yet; >= 0."""
    to_decode = min(
        request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens
    )
    unprocessed_prompt = request.num_prompt_tokens - request.num_computed_tokens
    return max(to_decode, 0) + max(unprocessed_prompt, 0)


class LRWOptions(BaseModel):
    """Options of `lrw-victim` (the `options:` mapping of its stack entry)."""

    model_config = ConfigDict(extra="forbid")

    max_preemptions: int = Field(
        2,
        ge=1,
        strict=True,
        description="a request preempted this many times is not chosen again while a "
        "running request preempted fewer times exists",
    )


class LRWVictim(TandemPlugin):
    """Chooses the preemption victim: the longest remaining work, with a starvation bound."""

    Options = LRWOptions

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, LRWOptions)
        self.max_preemptions = options.max_preemptions
        self.by_priority = config.scheduler.scheduling_policy == "priority"
        #: Victims chosen, in order (request ids), for tests and tracing.
        self.victims: list[str] = []

    def key(self, request: Request, position: int) -> tuple[int, int, int]:
        """Larger is preempted first: (priority class, remaining work, admission order)."""
        priority = request.priority if self.by_priority else 0
        return (priority, remaining_work(request, self.config.max_model_len), position)

    @hookimpl
    def select_preemption_victim(self, running: Sequence[Request], needed_by: Request) -> Request:
        ranked = list(enumerate(running))
        fresh = [(i, r) for i, r in ranked if r.num_preemptions < self.max_preemptions]
        _, victim = max(fresh or ranked, key=lambda item: self.key(item[1], item[0]))
        self.victims.append(victim.request_id)
        return victim
