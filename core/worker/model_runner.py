"""The model runner: worker-side request state, one flattened forward, sampling, drafting.

It mirrors the scheduler's incremental `SchedulerOutput`: a request's tokens and sampling
parameters arrive once (`scheduled_new_reqs`), then only deltas. After sampling it appends
the accepted tokens to its own copy of each request's history, so the next step's inputs
can be built without the scheduler resending them. A `StepModel` does the math: the
scripted test model or a real transformer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.core.model_runner_output import (
    AsyncModelRunnerOutput,
    ModelRunnerOutput,
    SamplerOutput,
    TokenLogprobs,
)
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.draft_context import DraftContext
from tandem.core.worker.flat_batch import FlatBatch, build_flat_batch
from tandem.core.worker.input_batch import InputBatch
from tandem.core.worker.logprobs import (
    PromptLogprobChunk,
    logprobs_per_request,
    prompt_logprob_chunk,
)
from tandem.core.worker.sample_isolation import sample_isolating_failures
from tandem.core.worker.sampling_metadata import SamplingMetadata
from tandem.sampling_params import SamplingParams, num_logprobs


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


@dataclass(slots=True)
class RunnerRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class ModelRunner:
    """Owns the worker's view of the requests and runs one step at a time.

    Contract: `execute_model(s)` then `sample_tokens(bitmask)` for the same step, in step
    order. Sampling may be deferred (called after the next step's `execute_model`), so the
    pending logits of each executed step are kept in a FIFO.

    Under async scheduling without a drafter, sampled ids stay on the device: the runner's
    history gets a `-1` placeholder per sampled token, the next step's input ids for those
    positions are copied on the device from `prev_sampled_token_ids` (one slice copy when
    the batch kept its order, an index scatter otherwise), and `sample_tokens` returns an
    `AsyncModelRunnerOutput` whose `get_output()` waits for the host copy.
    `update_async_output_token_ids()` replaces the placeholders with the real ids: at
    sampling when penalties or bad words need the history, otherwise once the step after
    has been sampled (the copy is long finished by then).
    """

    def __init__(
        self,
        model: StepModel,
        hooks: HookCaller,
        block_size: int,
        num_spec_tokens: int,
        async_scheduling: bool = False,
        keep_hidden_states: bool = False,
    ) -> None:
        self.model = model
        self.hooks = hooks
        self.block_size = block_size
        self.num_spec_tokens = num_spec_tokens
        #: Sampled ids stay on the device between steps (no drafter: drafters read them).
        self.async_scheduling = async_scheduling
        self.device_resident_outputs = async_scheduling and num_spec_tokens == 0
        #: The last step's sampled ids `[num_sampling_requests, 1]` on the device, and each
        #: request's row in it; the next step's inputs are filled from it on the device.
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_req_id_to_index: dict[str, int] = {}
        self._prev_host: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._copy_stream = (
            torch.cuda.Stream(model.device)
            if self.device_resident_outputs and model.device.type == "cuda"
            else None
        )
        self.requests: dict[str, RunnerRequestState] = {}
        self.input_batch = InputBatch(max_num_reqs=64)
        #: Executed, not yet sampled steps: (output, batch, logits, hidden states or None).
        self._pending: list[
            tuple[SchedulerOutput, FlatBatch, torch.Tensor, torch.Tensor | None]
        ] = []
        #: The drafter reads the target's last hidden states (`DraftContext.hidden_states`).
        self.keep_hidden_states = keep_hidden_states
        if keep_hidden_states:
            if not hasattr(model, "keep_hidden_states"):
                raise ValueError(
                    f"the drafter needs the target's hidden states, which "
                    f"{type(model).__name__} does not provide"
                )
            model.keep_hidden_states = True
        #: Requests finished or preempted since the drafter last ran (it frees their state).
        self._finished_for_drafter: list[str] = []
        #: The drafter's last proposal per request. Under async scheduling the scheduler
        #: schedules `-1` draft placeholders and the real drafts never leave the worker.
        self.drafts: dict[str, list[int]] = {}
        #: Prompt logprobs computed so far per request asking for them (one entry per
        #: prefill chunk), handed out with the request's first sampled token.
        self._prompt_logprobs: dict[str, list[PromptLogprobChunk]] = {}

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            self.requests.pop(req_id, None)
            self.drafts.pop(req_id, None)
            self.input_batch.remove(req_id)
            if self.num_spec_tokens:
                self._finished_for_drafter.append(req_id)
        for new in so.scheduled_new_reqs:
            self.input_batch.add(new.req_id, new.sampling_params)
            self.requests[new.req_id] = RunnerRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
            )
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            # Under async the scheduler planned this step before it learned how many drafts
            # of the step in flight were rejected, so its count may run ahead of the tokens
            # this worker knows: every known token but the last has its KV written.
            state.num_computed_tokens = min(cached.num_computed_tokens, len(state.token_ids) - 1)

    def execute_model(self, so: SchedulerOutput) -> None:
        self._update_states(so)
        self.input_batch.condense()
        row = self.input_batch.req_id_to_row
        req_ids = sorted(so.num_scheduled_tokens, key=row.__getitem__)
        states = [self.requests[r] for r in req_ids]
        num_scheduled = [so.num_scheduled_tokens[r] for r in req_ids]
        batch = build_flat_batch(
            req_ids=req_ids,
            token_ids=[s.token_ids for s in states],
            num_computed=[s.num_computed_tokens for s in states],
            num_scheduled=num_scheduled,
            drafts=[self._scheduled_drafts(so, r) for r in req_ids],
            block_ids=[s.block_ids for s in states],
            block_size=self.block_size,
            device=self.model.device,
        )
        if self.prev_sampled_token_ids is not None:
            self._fill_sampled_inputs(batch, states, num_scheduled)
        logits = self._forward(so, batch, states) if batch.num_tokens else torch.zeros(0, 1)
        hidden = None
        if self.keep_hidden_states and batch.num_tokens:
            hidden, self.model.last_hidden_states = self.model.last_hidden_states, None
        self._pending.append((so, batch, logits, hidden))

    def _forward(
        self, so: SchedulerOutput, batch: FlatBatch, states: list[RunnerRequestState]
    ) -> torch.Tensor:
        """The model's logits at the sampled rows. For requests asking for prompt logprobs
        (before their first output token), the logits of this chunk's prompt positions are
        computed in the same forward and turned into `PromptLogprobChunk`s."""
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            self._prompt_logprobs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self._prompt_logprobs.pop(new.req_id, None)
        # (state, first scheduled position, first extra logits row, rows)
        wanted: list[tuple[RunnerRequestState, int, int, int]] = []
        extra_rows: list[torch.Tensor] = []
        num_extra = 0
        offset = 0
        for state, start, n in zip(
            states, batch.num_computed_tokens, batch.num_scheduled_tokens, strict=True
        ):
            if state.sampling_params.prompt_logprobs is not None and state.num_output_tokens == 0:
                self._prompt_logprobs.setdefault(state.req_id, [])
                # Logits at position i score prompt token i + 1: positions up to P - 2.
                count = max(min(start + n, state.num_prompt_tokens - 1) - start, 0)
                if count:
                    first = batch.logits_indices.shape[0] + num_extra
                    wanted.append((state, start, first, count))
                    extra_rows.append(torch.arange(offset, offset + count, dtype=torch.int64))
                    num_extra += count
            offset += n
        if not wanted:
            return self.model.forward(batch)
        sample_rows = batch.logits_indices
        batch.logits_indices = torch.cat(
            [sample_rows, torch.cat(extra_rows).to(sample_rows.device)]
        )
        try:
            all_logits = self.model.forward(batch)
        finally:
            batch.logits_indices = sample_rows
        for state, start, first, count in wanted:
            self._prompt_logprobs[state.req_id].append(
                prompt_logprob_chunk(
                    all_logits[first : first + count],
                    state.token_ids[start + 1 : start + 1 + count],
                    num_logprobs(state.sampling_params.prompt_logprobs, all_logits.shape[1]) or 0,
                )
            )
        return all_logits[: sample_rows.shape[0]]

    def _take_prompt_logprobs(self, batch: FlatBatch) -> dict[str, list[TokenLogprobs]] | None:
        """Prompt logprobs of the requests that sample their first token in this step."""
        if not self._prompt_logprobs:
            return None
        taken: dict[str, list[TokenLogprobs]] = {}
        for r in batch.sample_req_indices:
            req_id = batch.req_ids[r]
            state = self.requests.get(req_id)
            if state is None or state.num_output_tokens != 0 or req_id not in self._prompt_logprobs:
                continue
            taken[req_id] = [
                entry for chunk in self._prompt_logprobs.pop(req_id) for entry in chunk.to_host()
            ]
        return taken or None

    def _fill_sampled_inputs(
        self, batch: FlatBatch, states: list[RunnerRequestState], num_scheduled: list[int]
    ) -> None:
        """Write the previous step's sampled ids, still on the device, into this step's
        input ids where the history holds their `-1` placeholders."""
        assert self.prev_sampled_token_ids is not None
        flat: list[int] = []
        prev: list[int] = []
        starts = list(itertools.accumulate(num_scheduled, initial=0))  # host: no device sync
        for r, state in enumerate(states):
            index = self.prev_req_id_to_index.get(state.req_id)
            if index is None or not state.token_ids or state.token_ids[-1] != -1:
                continue
            offset = len(state.token_ids) - 1 - state.num_computed_tokens
            if 0 <= offset < starts[r + 1] - starts[r]:
                flat.append(starts[r] + offset)
                prev.append(index)
        if not flat:
            return
        n = len(flat)
        source = self.prev_sampled_token_ids[:, 0]
        if flat == list(range(n)) and prev == list(range(n)):
            batch.input_ids[:n].copy_(source[:n], non_blocking=True)  # unchanged batch
            return
        device = batch.input_ids.device
        batch.input_ids.index_copy_(
            0,
            torch.tensor(flat, dtype=torch.int64).to(device, non_blocking=True),
            source.index_select(0, torch.tensor(prev, dtype=torch.int64).to(device)),
        )

    def update_async_output_token_ids(self) -> None:
        """Replace the last step's `-1` placeholders in the histories with the sampled ids,
        waiting for their host copy. A request preempted or finished since keeps no
        placeholder (it was removed, or re-added with real tokens) and is skipped."""
        if self._prev_host is None:
            return
        host, copy_done = self._prev_host
        self._prev_host = None
        if copy_done is not None:
            copy_done.synchronize()
        sampled = host[:, 0].tolist()
        for req_id, index in self.prev_req_id_to_index.items():
            state = self.requests.get(req_id)
            if state is not None and state.token_ids and state.token_ids[-1] == -1:
                state.token_ids[-1] = sampled[index]

    def _scheduled_drafts(self, so: SchedulerOutput, req_id: str) -> list[int]:
        """The draft tokens to verify for `req_id`: the scheduler's, or, where it scheduled
        `-1` placeholders (async), this worker's last proposal. A proposal shorter than the
        scheduled count is padded with token 0; verification accepts a draft only when it
        equals the target's own token, so padding never changes the output."""
        scheduled = so.scheduled_spec_decode_tokens.get(req_id, [])
        if not scheduled or scheduled[0] >= 0:
            return list(scheduled)
        real = self.drafts.get(req_id, [])[: len(scheduled)]
        return real + [0] * (len(scheduled) - len(real))

    def _sampling_metadata(
        self, batch: FlatBatch, grammar_bitmask: torch.Tensor | None
    ) -> SamplingMetadata:
        """Per sampled row: the request's persistent-batch row (parameters are gathered
        from its tensors), output position, blocked tokens and, when penalties need them,
        histories."""
        states = [self.requests[batch.req_ids[r]] for r in batch.sample_req_indices]
        need_history = any(
            st.sampling_params.presence_penalty != 0
            or st.sampling_params.frequency_penalty != 0
            or st.sampling_params.repetition_penalty != 1.0
            for st in states
        )
        if need_history or any(st.sampling_params.bad_words_token_ids for st in states):
            self.update_async_output_token_ids()
        vocab = self.model.vocab_size
        asked = [
            num_logprobs(st.sampling_params.logprobs, vocab)
            for st in states
            if st.sampling_params.logprobs is not None
        ]
        max_logprobs = max(asked) if asked else None  # type: ignore[type-var]
        ib = self.input_batch
        bias_rows: list[tuple[str, int, int]] = []  # (req id, first row, rows)
        allowed_rows: list[tuple[str, int, int]] = []
        rows: list[int] = []
        positions: list[int] = []
        histories: list[list[int]] = []
        prompts: list[list[int]] = []
        blocked_rows: list[int] = []
        blocked_ids: list[int] = []
        draft_end = 0
        for state, k in zip(states, batch.num_draft_tokens, strict=True):
            row = self.input_batch.req_id_to_row[state.req_id]
            # Row j is only used when drafts[:j] are accepted, i.e. are its real history:
            # penalties and bad words see them (vLLM's update_async_spec_token_ids).
            drafts = batch.draft_token_ids[draft_end : draft_end + k]
            draft_end += k
            if state.req_id in ib.logit_bias:
                bias_rows.append((state.req_id, len(rows), k + 1))
            if state.req_id in ib.allowed_token_ids:
                allowed_rows.append((state.req_id, len(rows), k + 1))
            output = state.token_ids[state.num_prompt_tokens :]
            for j in range(k + 1):
                for token in self._blocked_tokens(state, j, drafts[:j]):
                    blocked_rows.append(len(rows))
                    blocked_ids.append(token)
                rows.append(row)
                positions.append(state.num_output_tokens + j)
                if need_history:
                    histories.append(output + drafts[:j] if j else output)
                    prompts.append(state.token_ids[: state.num_prompt_tokens])
        device = self.model.device
        index = torch.tensor(rows, dtype=torch.int64)
        temperature = ib.temperature[index]

        def on_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)

        return SamplingMetadata(
            all_greedy=bool((temperature == 0).all()),
            temperature=on_device(temperature),
            top_k=on_device(ib.top_k[index]),
            top_p=on_device(ib.top_p[index]),
            min_p=on_device(ib.min_p[index]),
            seeds=on_device(ib.seeds[index]),
            seeded=on_device(ib.seeded[index]),
            logit_bias=_sparse_rows(bias_rows, ib.logit_bias, device),
            allowed_token_ids=_sparse_rows(allowed_rows, ib.allowed_token_ids, device),
            output_positions=torch.tensor(positions, dtype=torch.int64, device=device),
            num_draft_tokens=batch.num_draft_tokens,
            draft_token_ids=torch.tensor(batch.draft_token_ids, dtype=torch.int64, device=device),
            output_token_ids=histories if need_history else None,
            prompt_token_ids=prompts if need_history else None,
            penalties=(ib.presence[index], ib.frequency[index], ib.repetition[index])
            if need_history
            else None,
            grammar_bitmask=grammar_bitmask,
            max_num_logprobs=max_logprobs,
            blocked_tokens=(
                torch.tensor(blocked_rows, dtype=torch.int64, device=device),
                torch.tensor(blocked_ids, dtype=torch.int64, device=device),
            )
            if blocked_rows
            else None,
        )

    @staticmethod
    def _blocked_tokens(
        state: RunnerRequestState, offset: int, drafts: list[int] | None = None
    ) -> list[int]:
        """Tokens the row sampling output `num_output_tokens + offset` must not produce:
        EOS and stop tokens before `min_tokens`, and the last token of each bad word whose
        other tokens end the history (the outputs followed by the row's preceding
        `drafts`)."""
        params = state.sampling_params
        blocked: list[int] = []
        if state.num_output_tokens + offset < params.min_tokens:
            if not params.ignore_eos and state.eos_token_id is not None:
                blocked.append(state.eos_token_id)
            blocked.extend(params.stop_token_ids)
        if params.bad_words_token_ids:
            history = state.token_ids[state.num_prompt_tokens :] + (drafts or [])
            for word in params.bad_words_token_ids:
                prefix = word[:-1]
                if not prefix or history[len(history) - len(prefix) :] == prefix:
                    blocked.append(word[-1])
        return blocked

    def sample_tokens(
        self, grammar_bitmask: torch.Tensor | None = None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        so, batch, logits, hidden = self._pending.pop(0)
        prompt_logprobs = self._take_prompt_logprobs(batch)
        result: SamplerOutput | None = None
        failures: dict[int, str] = {}
        if batch.sample_req_indices:
            if grammar_bitmask is not None:
                grammar_bitmask = self._expand_grammar_bitmask(so, batch, grammar_bitmask)
            result, failures = self._sample(batch, logits, grammar_bitmask)
        num_top = [
            None
            if r in failures
            else num_logprobs(
                self.requests[batch.req_ids[r]].sampling_params.logprobs, self.model.vocab_size
            )
            for r in batch.sample_req_indices
        ]
        failed = {batch.req_ids[r]: message for r, message in failures.items()}
        if self.device_resident_outputs:
            pending = self._keep_on_device(batch, result, num_top, failed)
            pending.prompt_logprobs = prompt_logprobs
            return pending
        sampled_rows: list[list[int]] = [[] for _ in batch.req_ids]
        logprobs: list[list[dict[int, tuple[float, int]]] | None] | None = None
        if result is not None:
            rows = result.sampled_token_ids.tolist()
            for r, row in zip(batch.sample_req_indices, rows, strict=True):
                tokens = [t for t in row if t >= 0]
                sampled_rows[r] = tokens
                self.requests[batch.req_ids[r]].token_ids.extend(tokens)
            if result.logprobs is not None:
                logprobs = logprobs_per_request(
                    len(batch.req_ids),
                    batch.sample_req_indices,
                    batch.num_draft_tokens,
                    num_top,
                    sampled_rows,
                    result.logprobs,
                )
        drafts = self._propose_drafts(batch, sampled_rows, hidden)
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
            sampled_token_ids=sampled_rows,
            logprobs=logprobs,
            # Under async the scheduler keeps `-1` draft placeholders; the drafts stay here.
            draft_token_ids=None if self.async_scheduling else drafts,
            kept_draft_token_ids=drafts if self.async_scheduling else None,
            failed=failed,
            prompt_logprobs=prompt_logprobs,
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

    def _expand_grammar_bitmask(
        self, so: SchedulerOutput, batch: FlatBatch, bitmask: torch.Tensor
    ) -> torch.Tensor:
        """The grammar backend's rows (1 + drafts per request of
        `so.structured_output_request_ids`, in that order) placed at this batch's sampled
        rows; unconstrained rows allow every token (all bits set)."""
        start: dict[str, int] = {}
        row = 0
        for req_id in so.structured_output_request_ids:
            start[req_id] = row
            row += 1 + len(so.scheduled_spec_decode_tokens.get(req_id, ()))
        if bitmask.shape[0] != row:
            raise ValueError(
                f"grammar_bitmask: {bitmask.shape[0]} rows, expected {row} (1 + drafts for "
                "each request of structured_output_request_ids)"
            )
        source: list[int] = []
        target: list[int] = []
        out_row = 0
        for r, k in zip(batch.sample_req_indices, batch.num_draft_tokens, strict=True):
            first = start.get(batch.req_ids[r])
            if first is not None:
                source.extend(range(first, first + k + 1))
                target.extend(range(out_row, out_row + k + 1))
            out_row += k + 1
        full = torch.full((out_row, bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device)
        if source:
            full[torch.tensor(target, device=bitmask.device)] = bitmask[
                torch.tensor(source, device=bitmask.device)
            ]
        return full.to(self.model.device)

    def _keep_on_device(
        self,
        batch: FlatBatch,
        result: SamplerOutput | None,
        num_top: list[int | None],
        failed: dict[str, str],
    ) -> AsyncModelRunnerOutput:
        """Async path: start the host copy, append `-1` placeholders, keep the ids on the
        device for the next step's inputs."""
        self.update_async_output_token_ids()  # the step before: its copy is long done
        device = self.model.device
        sampled = (
            result.sampled_token_ids[:, :1]
            if result is not None
            else torch.zeros(0, 1, dtype=torch.int64, device=device)
        )
        logprobs = result.logprobs if result is not None else None
        copy_done: torch.cuda.Event | None = None
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._copy_stream):
                host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
                host.copy_(sampled, non_blocking=True)
                if logprobs is not None:
                    logprobs = tuple(t.to("cpu", non_blocking=True) for t in logprobs)  # type: ignore[assignment]
                copy_done = torch.cuda.Event()
                copy_done.record(self._copy_stream)
        else:
            host = sampled.to("cpu", copy=True)
        for r in batch.sample_req_indices:
            self.requests[batch.req_ids[r]].token_ids.append(-1)
        self.prev_sampled_token_ids = sampled
        self.prev_req_id_to_index = {
            batch.req_ids[r]: i for i, r in enumerate(batch.sample_req_indices)
        }
        self._prev_host = (host, copy_done)
        return AsyncModelRunnerOutput(
            req_ids=batch.req_ids,
            sample_req_indices=batch.sample_req_indices,
            num_top_logprobs=num_top,
            sampled_token_ids=host,
            logprobs=logprobs,
            copy_done=copy_done,
            failed=failed,
        )

    def _propose_drafts(
        self, batch: FlatBatch, sampled_rows: list[list[int]], hidden: torch.Tensor | None
    ) -> dict[str, list[int]] | None:
        """Ask the drafter for the next step's drafts. It sees every request of the step
        (prefill chunks that did not sample with empty `sampled_token_ids`); only the
        sampling requests' proposals are kept and returned."""
        if self.num_spec_tokens == 0:
            return None
        indices = [r for r, req_id in enumerate(batch.req_ids) if req_id in self.requests]
        req_ids = [batch.req_ids[r] for r in indices]
        states = [self.requests[r] for r in req_ids]
        num_drafts = dict(zip(batch.sample_req_indices, batch.num_draft_tokens, strict=True))
        counts = batch.num_scheduled_tokens
        valid = [
            counts[r] - num_drafts[r] + max(len(sampled_rows[r]) - 1, 0)
            if r in num_drafts
            else counts[r]
            for r in indices
        ]
        finished, self._finished_for_drafter = self._finished_for_drafter, []
        context = DraftContext(
            req_ids=req_ids,
            token_ids=[s.token_ids for s in states],
            sampled_token_ids=[sampled_rows[r] for r in indices],
            num_spec_tokens=self.num_spec_tokens,
            hidden_states=hidden,
            target=self.model,
            batch=batch,
            batch_index=indices,
            num_computed_tokens=[batch.num_computed_tokens[r] for r in indices],
            num_valid_tokens=valid,
            block_ids=[s.block_ids for s in states],
            finished_req_ids=finished,
        )
        proposed = self.hooks.propose_drafts(context=context)
        if proposed is None:
            return {}
        sampling = set(batch.sample_req_indices)
        drafts = {
            req_id: list(d[: self.num_spec_tokens])
            for r, req_id, d in zip(indices, req_ids, proposed, strict=True)
            if r in sampling
        }
        self.drafts.update(drafts)
        return drafts


def _sparse_rows(
    spans: list[tuple[str, int, int]],
    per_request: dict[str, tuple[torch.Tensor, torch.Tensor]] | dict[str, torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, ...] | None:
    """(rows, token ids[, values]) for per-request sparse parameters: each request's
    tensors repeated over its `count` consecutive rows starting at `first`."""
    if not spans:
        return None
    parts: list[list[torch.Tensor]] = []
    for req_id, first, count in spans:
        value = per_request[req_id]
        tensors = value if isinstance(value, tuple) else (value,)
        width = tensors[0].shape[0]
        rows = torch.arange(first, first + count, dtype=torch.int64).repeat_interleave(width)
        parts.append([rows, *(t.repeat(count) for t in tensors)])
    return tuple(torch.cat(column).to(device) for column in zip(*parts, strict=True))
