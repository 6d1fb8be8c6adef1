"""The model runner: one step at a time, from the scheduler's incremental plan to sampled ids.

It composes the worker's pieces, each in its own file:

- `InputBatch` (input_batch.py): the persistent rows: token ids, ledger, block table and
  sampling parameters, changed only by the incremental `SchedulerOutput` and the step's
  own results;
- `prepare_flat_batch` (flat_batch.py): the step's flattened inputs, gathered from it;
- `build_sampling_metadata` (sampling_inputs.py): the sampler's per-row inputs;
- `DeviceOutputs` (async_output.py): async scheduling without a drafter, sampled ids kept
  on the device;
- `DraftStore` (drafts.py): the drafter's proposals, the one owner of drafts;
- `PromptLogprobs` (logprobs.py): prompt logprobs collected over prefill chunks.

A `StepModel` does the math: the scripted test model or a real transformer.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Protocol

import torch

from tandem.core.model_runner_output import (
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
    SamplerOutput,
)
from tandem.core.scheduler_output import CachedRequestData, SchedulerOutput
from tandem.core.worker import parallel_state
from tandem.core.worker.async_output import DeviceOutputs
from tandem.core.worker.draft_context import DraftContext
from tandem.core.worker.drafts import DraftStore
from tandem.core.worker.flat_batch import FlatBatch, prepare_flat_batch
from tandem.core.worker.host_tensors import host_int64
from tandem.core.worker.input_batch import InputBatch
from tandem.core.worker.logprobs import PromptLogprobs, logprobs_per_request
from tandem.core.worker.pipeline import AwaitedStep, PipelineLink, pack_sampled, sampled_width
from tandem.core.worker.sample_isolation import sample_isolating_failures
from tandem.core.worker.sampling_inputs import (
    build_sampling_metadata,
    expand_grammar_bitmask,
    needs_history,
)
from tandem.core.worker.sampling_metadata import SamplingMetadata
from tandem.schema.sampling_params import num_logprobs

logger = logging.getLogger("tandem.worker")


class StepModel(Protocol):
    """Computes logits for one flattened step, reading and writing its paged KV cache."""

    vocab_size: int
    device: torch.device

    def forward(self, batch: FlatBatch) -> torch.Tensor:
        """Write the batch's KV at `slot_mapping`, return float32 logits `[len(logits_indices), vocab]`."""
        ...


class HookCaller(Protocol):
    """The worker-side plugin manager's hook relay (`pm.hook`)."""

    def sample(self, *, logits: torch.Tensor, metadata: SamplingMetadata): ...  # noqa: ANN201

    def propose_drafts(self, *, context: DraftContext): ...  # noqa: ANN201


class ModelRunner:
    """Runs one step at a time over the worker's persistent input batch.

    Contract: `execute_model(s)` then `sample_tokens(bitmask)` for the same step, in step
    order. Sampling may be deferred (called after the next step's `execute_model`), so the
    pending logits of each executed step are kept in a FIFO.

    Ledger: each row's `num_computed_tokens` is the worker's own count, advanced by what it
    executed and rolled back by the drafts the sampler rejected. The scheduler's
    `CachedRequestData.num_computed_tokens` is a claim checked against it (see
    `CachedRequestData`); a claim outside the allowed range raises instead of being
    corrected.
    """

    def __init__(
        self,
        model: StepModel,
        hooks: HookCaller,
        block_size: int,
        num_spec_tokens: int,
        async_scheduling: bool = False,
        keep_hidden_states: bool = False,
        max_num_reqs: int = 64,
    ) -> None:
        self.model = model
        self.hooks = hooks
        self.block_size = block_size
        self.num_spec_tokens = num_spec_tokens
        self.async_scheduling = async_scheduling
        self.input_batch = InputBatch(max_num_reqs=max_num_reqs)  # grows by doubling
        self.prompt_logprobs = PromptLogprobs()
        rank = parallel_state.current()
        #: Pipeline stages (`pipeline.py`): the last samples, drafts and sends the ids and
        #: proposals back; an earlier stage applies each step's once a later step needs them
        #: (`_awaiting`).
        self.pipeline = PipelineLink(rank) if rank.pp_size > 1 else None
        self.samples = self.pipeline is None or self.pipeline.is_last
        self.drafts = DraftStore(num_spec_tokens, runs_drafter=self.samples)
        #: What a model-based drafter reads of the target (None without drafts, or for a
        #: model that offers no `draft_target()`, or a pipeline stage that does not draft).
        make_target = getattr(model, "draft_target", None)
        wants_target = bool(num_spec_tokens) and make_target is not None and self.samples
        self.draft_target = make_target() if wants_target else None
        self._awaiting: deque[AwaitedStep] = deque()
        #: Sampled ids stay on the device between steps (no drafter: drafters read them).
        self.device_outputs = (
            DeviceOutputs(model.device)
            if async_scheduling and num_spec_tokens == 0 and self.samples
            else None
        )
        #: Executed, not yet sampled steps: (output, batch, logits, hidden states or None,
        #: the requests whose inputs failed in that step with the reason).
        self._pending: list[
            tuple[SchedulerOutput, FlatBatch, torch.Tensor, torch.Tensor | None, dict[str, str]]
        ] = []
        #: Requests whose own inputs could not be prepared: left out of every step until the
        #: scheduler reports them finished (the kernel ends them with their error).
        self._excluded: set[str] = set()
        #: The drafter reads the target's last hidden states (`DraftContext.hidden_states`).
        self.keep_hidden_states = keep_hidden_states
        if keep_hidden_states:
            if not hasattr(model, "keep_hidden_states"):
                raise ValueError(
                    f"the drafter needs the target's hidden states, which "
                    f"{type(model).__name__} does not provide"
                )
            model.keep_hidden_states = True

    # Executing a step ----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> dict[str, str]:
        """Apply the step's request changes to the input batch. A new request whose own
        data cannot be put in the batch (a parameter no validation caught) is left out and
        returned as {id: reason}; the other requests go on."""
        ib = self.input_batch
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            ib.remove(req_id)
            self.drafts.forget(req_id)
            self.prompt_logprobs.forget(req_id)
            self._excluded.discard(req_id)
        failed: dict[str, str] = {}
        for new in so.scheduled_new_reqs:
            try:
                if new.input_error is not None:
                    raise ValueError(new.input_error)
                ib.add_new(new)
            except Exception as exc:  # this request's own data: end it alone
                ib.remove(new.req_id)
                failed[new.req_id] = f"input preparation failed: {type(exc).__name__}: {exc}"
                logger.warning("request %s: %s", new.req_id, failed[new.req_id])
                continue
            self.prompt_logprobs.admit(
                new.req_id,
                new.sampling_params.prompt_logprobs is not None
                and len(new.token_ids) == new.num_prompt_tokens,
            )
        self._excluded.update(failed)
        if so.scheduled_cached_reqs:
            self._update_cached([c for c in so.scheduled_cached_reqs if c.req_id in ib.states])
        ib.condense()
        return failed

    def _update_cached(self, cached: list[CachedRequestData]) -> None:
        """Append the new blocks of running requests. The worker's own count of computed
        tokens (advanced by what it executed, minus the drafts it rejected, which it
        reports as `num_rejected_drafts`) is where each step starts; the scheduler's
        `num_computed_tokens` is not read."""
        ib = self.input_batch
        row_of = ib.req_id_to_row
        for c in cached:
            if c.new_block_ids:
                ib.block_table.append(row_of[c.req_id], c.new_block_ids)

    def _prepare_inputs(self, so: SchedulerOutput) -> FlatBatch:
        """The step's flattened inputs, for the scheduled requests in row order."""
        ib = self.input_batch
        scheduled = so.num_scheduled_tokens
        if self._excluded:
            scheduled = {r: n for r, n in scheduled.items() if r not in self._excluded}
        if len(scheduled) == ib.num_rows:  # every row runs (no holes after condense)
            req_ids = [r for r in ib.req_ids if r is not None]
            rows = list(range(len(req_ids)))
        else:
            row_of = ib.req_id_to_row
            req_ids = sorted(scheduled, key=row_of.__getitem__)
            rows = [row_of[r] for r in req_ids]
        return prepare_flat_batch(
            ib,
            req_ids,
            rows,
            [scheduled[r] for r in req_ids],
            {r: d for r, d in self.drafts.to_verify(so).items() if r not in self._excluded},
            self.block_size,
            self.model.device,
            find_placeholders=self.device_outputs is not None,
        )

    def execute_model(self, so: SchedulerOutput) -> None:
        if not self.samples:  # ids a request of this step may read were sampled by now
            assert self.pipeline is not None
            self._apply_received(up_to_step=so.step_id - self.pipeline.info.pp_size)
        failed_inputs = self._update_states(so)
        batch = self._prepare_inputs(so)
        if self.device_outputs is not None:
            self.device_outputs.fill_sampled_inputs(batch)
        logits = self._forward(batch) if batch.num_tokens else torch.zeros(0, 1)
        hidden = None
        if self.keep_hidden_states and batch.num_tokens:
            hidden, self.model.last_hidden_states = self.model.last_hidden_states, None
        self._pending.append((so, batch, logits, hidden, failed_inputs))

    def _forward(self, batch: FlatBatch) -> torch.Tensor:
        """The model's logits at the sampled rows. For requests collecting prompt logprobs,
        the logits of this chunk's prompt positions are computed in the same forward."""
        if not self.samples:  # a pipeline stage before the last: no logits here
            return self.model.forward(batch)
        ib = self.input_batch
        wanted, extra = self.prompt_logprobs.extra_logits_rows(
            batch, {r: ib.states[r].num_prompt_tokens for r in self.prompt_logprobs.chunks}
        )
        if extra is None:
            return self.model.forward(batch)
        sample_rows = batch.logits_indices
        batch.logits_indices = torch.cat([sample_rows, extra.to(sample_rows.device)])
        try:
            all_logits = self.model.forward(batch)
        finally:
            batch.logits_indices = sample_rows
        token_ids = ib.token_ids
        next_ids = [
            token_ids[ib.req_id_to_row[r], start + 1 : start + 1 + count].tolist()
            for r, start, _, count in wanted
        ]
        num_top = [
            num_logprobs(ib.states[r].sampling_params.prompt_logprobs, all_logits.shape[1]) or 0
            for r, *_ in wanted
        ]
        self.prompt_logprobs.add_chunks(all_logits, wanted, next_ids, num_top)
        return all_logits[: sample_rows.shape[0]]

    # Sampling a step -----------------------------------------------------------------------
    def sample_tokens(
        self, grammar_bitmask: torch.Tensor | None = None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        so, batch, logits, hidden, failed_inputs = self._pending.pop(0)
        sampling = [batch.req_ids[r] for r in batch.sample_req_indices]
        if not self.samples:
            return self._await_sampled(so, batch, sampling, failed_inputs)
        prompt_logprobs = self.prompt_logprobs.take(sampling)
        result: SamplerOutput | None = None
        failures: dict[int, str] = {}
        if sampling:
            if grammar_bitmask is not None:
                grammar_bitmask = expand_grammar_bitmask(
                    so, batch, grammar_bitmask, self.model.device
                )
            result, failures = self._sample(batch, logits, grammar_bitmask)
            if self.pipeline is not None and not self.num_spec_tokens:
                self._send_sampled(result, list(failures))
        states = self.input_batch.states
        num_top = [
            None
            if r in failures
            else num_logprobs(states[req_id].sampling_params.logprobs, self.model.vocab_size)
            for r, req_id in zip(batch.sample_req_indices, sampling, strict=True)
        ]
        failed = {**failed_inputs, **{batch.req_ids[r]: m for r, m in failures.items()}}
        if self.device_outputs is not None:
            pending = self.device_outputs.keep(batch, self.input_batch, result, num_top, failed)
            pending.prompt_logprobs = prompt_logprobs
            return pending
        sampled_rows: list[list[int]] = [[] for _ in batch.req_ids]
        logprobs = None
        num_rejected: dict[str, int] = {}
        if result is not None:
            sampled = result.sampled_token_ids.cpu()
            for r, row in zip(batch.sample_req_indices, sampled.tolist(), strict=True):
                sampled_rows[r] = [t for t in row if t >= 0]
            rows = self.input_batch.rows_of(sampling)
            self.input_batch.append_sampled(rows, sampled, host_int64(batch.num_draft_tokens))
            if batch.num_draft_tokens:  # the drafts each rejected (explicit deltas)
                rejected = self.input_batch.num_rejected[rows].tolist()
                num_rejected = {
                    req_id: n
                    for req_id, n, verified in zip(
                        sampling, rejected, batch.num_draft_tokens, strict=True
                    )
                    if verified
                }
            if result.logprobs is not None:
                logprobs = logprobs_per_request(
                    len(batch.req_ids),
                    batch.sample_req_indices,
                    batch.num_draft_tokens,
                    num_top,
                    sampled_rows,
                    result.logprobs,
                )
        drafts, draft_failures = self.drafts.propose(
            self.hooks, batch, self.input_batch, sampled_rows, hidden, self.draft_target
        )
        if self.pipeline is not None and self.num_spec_tokens and result is not None:
            self._send_sampled(result, list(failures), [(drafts or {}).get(r) for r in sampling])
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
            sampled_token_ids=sampled_rows,
            logprobs=logprobs,
            draft_token_ids=drafts,
            num_rejected_drafts=num_rejected,
            failed={**failed, **draft_failures},
            prompt_logprobs=prompt_logprobs,
        )

    def _await_sampled(
        self, so: SchedulerOutput, batch: FlatBatch, sampling: list[str], failed: dict[str, str]
    ) -> ModelRunnerOutput:
        """A stage before the last: post the receive of this step's sampled ids from the
        last stage and return at once (the engine reads the last stage's output)."""
        assert self.pipeline is not None
        self.prompt_logprobs.take(sampling)
        width = sampled_width(self.num_spec_tokens)
        work = self.pipeline.post_recv_sampled(len(sampling), width) if sampling else None
        self._awaiting.append(AwaitedStep(so.step_id, batch, sampling, work, self.num_spec_tokens))
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
            sampled_token_ids=[[] for _ in batch.req_ids],
            failed=failed,
        )

    def _apply_received(self, up_to_step: int) -> None:
        """Append the last stage's sampled ids of every awaited step up to `up_to_step`
        to the input batch, in step order, for the requests still in it (a request
        finished or preempted since has left). Waits for ids still in flight."""
        while self._awaiting and self._awaiting[0].step_id <= up_to_step:
            self._awaiting.popleft().apply(self.input_batch, self.drafts.proposals)

    def _send_sampled(
        self,
        result: SamplerOutput,
        failed_rows: list[int],
        proposals: list[list[int] | None] | None = None,
    ) -> None:
        """Last stage: the step's accepted ids, the drafter's proposals and the failed rows
        to every earlier stage (`pipeline.pack_sampled`)."""
        assert self.pipeline is not None
        self.pipeline.send_sampled(
            pack_sampled(result.sampled_token_ids, failed_rows, self.num_spec_tokens, proposals)
        )

    def _sample(
        self, batch: FlatBatch, logits: torch.Tensor, grammar_bitmask: torch.Tensor | None
    ) -> tuple[SamplerOutput, dict[int, str]]:
        """Run the `sample` hook over the batch; when it raises, find the requests that
        fail alone and sample the others (`sample_isolating_failures`)."""

        def sample(rows: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput | None:
            with torch.inference_mode():  # logits may be inference tensors; samplers write in place
                return self.hooks.sample(logits=rows, metadata=metadata)

        try:
            result = sample(logits, self._sampling_metadata(batch, grammar_bitmask))
        except Exception as exc:
            return sample_isolating_failures(
                sample, self._sampling_metadata, batch, logits, grammar_bitmask, exc
            )
        if result is None:
            raise RuntimeError("no plugin answered the `sample` hook: the stack needs a sampler")
        return result, {}

    def _sampling_metadata(
        self, batch: FlatBatch, grammar_bitmask: torch.Tensor | None
    ) -> SamplingMetadata:
        """The sampler's inputs for `batch`'s sampling requests; async placeholders are
        resolved first when penalties or bad words read the histories."""
        if self.device_outputs is not None and needs_history(
            self.input_batch, [batch.req_ids[r] for r in batch.sample_req_indices]
        ):
            self.device_outputs.resolve(self.input_batch)
        return build_sampling_metadata(
            self.input_batch, batch, grammar_bitmask, self.model.vocab_size, self.model.device
        )

    def update_async_output_token_ids(self) -> None:
        """Replace the input batch's `-1` placeholders of the last step with the real ids."""
        if self.device_outputs is not None:
            self.device_outputs.resolve(self.input_batch)
