"""One step's batch as a cost model sees it (`step_cost` hook of the simulated device)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepShape:
    """The shape of one engine step, per scheduled request in scheduling order.

    `query_lens[i]`: tokens request i computes this step (a prefill chunk, 1 for a plain
    decode, 1 + k when verifying k drafts, a canvas length for block diffusion).
    `context_lens[i]`: tokens already in its KV cache before this step (the attention
    span is `context_lens[i] + query_lens[i]`). `num_sampled`: requests that sample a
    token this step. `tensor_parallel_size`/`pipeline_parallel_size`: the ranks the step
    runs on. Invariant: `len(query_lens) == len(context_lens)`, every entry >= 0.
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_sampled: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of requests computing more than one token from an empty-ish context:
        every query longer than one token (prefill chunks, draft verification, canvases)."""
        return sum(q for q in self.query_lens if q > 1)

    @property
    def num_decode_reqs(self) -> int:
        return sum(1 for q in self.query_lens if q == 1)


def step_shape_of(
    scheduler_output: SchedulerOutput,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> StepShape:
    """The shape of a planned step. Context lengths are the scheduler's `num_computed_tokens`
    as sent; every scheduled request counts as sampled (an upper bound: a prefill chunk that
    does not reach the prompt's end samples nothing; the LM-head term it overstates is small)."""
    computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    for cached in scheduler_output.scheduled_cached_reqs:
        computed[cached.req_id] = cached.num_computed_tokens
    scheduled = scheduler_output.num_scheduled_tokens
    return StepShape(
        query_lens=tuple(scheduled.values()),
        context_lens=tuple(computed.get(rid, 0) for rid in scheduled),
        num_sampled=len(scheduled),
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
    )
