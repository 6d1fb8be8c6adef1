"""The worker's side of drafting: the drafter glue, and the copy of the last proposal that
async scheduling's placeholders stand for.

The scheduler owns the drafts. After each sampled step the `propose_drafts` hook proposes
the next drafts of every sampling request; they go to the scheduler in
`ModelRunnerOutput.draft_token_ids`, which records them (`Request.draft_token_ids`) and
schedules them, and the verdicts come back as explicit deltas
(`ModelRunnerOutput.num_rejected_drafts`). The worker verifies the scheduled ids. Only
where the scheduler cannot know them yet (async scheduling: the step that proposed them
is still in flight, so it schedules `-1` placeholders, as the specification's async
scheduler does) the worker verifies its kept copy of that proposal, cut or padded to the
scheduled count by `drafts_to_verify` — the helper the grammar backends use too, so their
draft rows are the drafts verified here. On a pipeline stage before the last the copy
arrives from the last stage (`pipeline.AwaitedStep`). A request that finishes or is
preempted loses its copy, and the drafter is told (`DraftContext.finished_req_ids`).

A drafter that raises is asked again for each request alone: the requests that fail alone
are reported as failed (the kernel ends each with `finish_reason == "error"`), the others
get their drafts from one more call without them. When every request drafts fine alone,
the step's error is raised again (nothing can be blamed on one request).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

import torch

from tandem.core.scheduler_output import SchedulerOutput, drafts_to_verify
from tandem.core.worker.draft_context import DraftContext, DraftTarget
from tandem.core.worker.flat_batch import FlatBatch
from tandem.core.worker.input_batch import InputBatch

logger = logging.getLogger("tandem.worker")


class ProposeHook(Protocol):
    def propose_drafts(self, *, context: DraftContext) -> Any: ...


class DraftStore:
    """Latest proposal per request (at most `num_spec_tokens` drafts each)."""

    def __init__(self, num_spec_tokens: int, runs_drafter: bool = True) -> None:
        """`runs_drafter`: False on a pipeline stage before the last, whose proposals come
        from the last stage (`pipeline.AwaitedStep.apply`)."""
        self.num_spec_tokens = num_spec_tokens
        self.runs_drafter = runs_drafter
        self.proposals: dict[str, list[int]] = {}
        #: Requests finished or preempted since the drafter last ran (it frees their state).
        self._left: list[str] = []

    def forget(self, req_id: str) -> None:
        """The request finished or was preempted: its proposal is gone."""
        self.proposals.pop(req_id, None)
        if self.num_spec_tokens and self.runs_drafter:
            self._left.append(req_id)

    def to_verify(self, so: SchedulerOutput) -> dict[str, list[int]]:
        """The drafts each request of the step verifies (only requests with drafts): the
        scheduler's own ids, or in place of `-1` placeholders (async scheduling: the
        scheduler has not received the proposal yet) the kept proposal."""
        return {
            req_id: list(scheduled)
            if scheduled[0] >= 0
            else drafts_to_verify(scheduled, self.proposals.get(req_id, ()))
            for req_id, scheduled in so.scheduled_spec_decode_tokens.items()
            if scheduled
        }

    def propose(
        self,
        hooks: ProposeHook,
        batch: FlatBatch,
        input_batch: InputBatch,
        sampled_rows: list[list[int]],
        hidden: torch.Tensor | None,
        target: DraftTarget | None,
    ) -> tuple[dict[str, list[int]] | None, dict[str, str]]:
        """Ask the drafter for the next step's drafts (None without a drafter) and return
        them with the requests whose drafting failed ({id: reason}, see the module
        docstring). The drafter sees every request of the step (prefill chunks that did not
        sample with empty `sampled_token_ids`); only the sampling requests' proposals are
        kept and returned. `input_batch` already holds the step's accepted tokens."""
        if self.num_spec_tokens == 0:
            return None, {}
        row_of = input_batch.req_id_to_row
        indices = [r for r, req_id in enumerate(batch.req_ids) if req_id in row_of]
        req_ids = [batch.req_ids[r] for r in indices]
        num_drafts = dict(zip(batch.sample_req_indices, batch.num_draft_tokens, strict=True))
        counts = batch.num_scheduled_tokens
        valid = [
            counts[r] - num_drafts[r] + max(len(sampled_rows[r]) - 1, 0)
            if r in num_drafts
            else counts[r]
            for r in indices
        ]
        left, self._left = self._left, []
        context = DraftContext(
            req_ids=req_ids,
            token_ids=[input_batch.token_ids_of(r) for r in req_ids],
            sampled_token_ids=[sampled_rows[r] for r in indices],
            num_spec_tokens=self.num_spec_tokens,
            hidden_states=hidden,
            target=target,
            batch=batch,
            batch_index=indices,
            num_computed_tokens=[batch.num_computed_tokens[r] for r in indices],
            num_valid_tokens=valid,
            block_ids=[input_batch.block_table.block_ids(row_of[r]) for r in req_ids],
            finished_req_ids=left,
        )
        failed: dict[str, str] = {}
        try:
            proposed = hooks.propose_drafts(context=context)
        except Exception as exc:
            proposed, failed = _propose_isolating_failures(hooks, context, exc)
        if proposed is None:
            return {}, failed
        drafts = {
            req_id: list(d[: self.num_spec_tokens])
            for r, req_id, d in zip(indices, req_ids, proposed, strict=True)
            if r in num_drafts and req_id not in failed
        }
        self.proposals.update(drafts)
        return drafts, failed


def _subset(context: DraftContext, positions: list[int]) -> DraftContext:
    """`context` with only the requests at `positions` (the step's tensors are shared)."""
    per_request = (
        "req_ids",
        "token_ids",
        "sampled_token_ids",
        "batch_index",
        "num_computed_tokens",
        "num_valid_tokens",
        "block_ids",
    )
    picked = {}
    for name in per_request:
        values = getattr(context, name)
        picked[name] = [values[p] for p in positions] if values else values
    return dataclasses.replace(context, **picked)


def _propose_isolating_failures(
    hooks: ProposeHook, context: DraftContext, error: Exception
) -> tuple[list[list[int]] | None, dict[str, str]]:
    """Proposals shaped as the batched call's (one list per request; none for a failed
    one) and the failures, after the batched call raised `error`."""
    failed: dict[str, str] = {}
    for p, req_id in enumerate(context.req_ids):
        try:
            hooks.propose_drafts(context=_subset(context, [p]))
        except Exception as exc:  # this request's own failure
            failed[req_id] = f"drafting failed: {type(exc).__name__}: {exc}"
            logger.warning("request %s: %s", req_id, failed[req_id])
    if not failed:
        raise error
    good = [p for p, req_id in enumerate(context.req_ids) if req_id not in failed]
    proposals: list[list[int]] = [[] for _ in context.req_ids]
    if good:
        answer = hooks.propose_drafts(context=_subset(context, good))
        if answer is None:
            return None, failed
        for p, drafts in zip(good, answer, strict=True):
            proposals[p] = list(drafts)
    return proposals, failed
