"""The model runner's path for block-diffusion models (`core/worker/block_diffusion.py`).

`ModelRunner` picks it once, at construction, when its model is a `BlockDiffusionModel`,
and forwards `execute_model` / `sample_tokens` to it. Per step, from the scheduler's plan
(see `plugins/diffusion_scheduler.py`): a request's scheduled tokens are C causal tokens
(prompt chunk or last commit) followed by, when `scheduled_spec_decode_tokens` has it, its
L canvas positions.

- `execute_model`: one `encode` over the flattened causal tokens of every request that has
  some (KV written through the paged cache, advancing the row's `num_computed_tokens`),
  then one `denoise` per canvas length over the requests denoising this step (their context
  is then complete: `context_lens = num_computed_tokens = num_tokens`). A request's first
  step of a canvas draws its initial random canvas (generator keyed (seed, canvas, -1)).
- `sample_tokens`: the `sample` hook (the denoising sampler) on the canvas logits with a
  `DenoiseMetadata`; rows that commit get their committed tokens appended to the row's
  history (the next step encodes them) and start the next canvas; the others keep their
  canvas, self-conditioning logits and stopping state (`diffusion_state.CanvasState`).

A finished or preempted request's decoder-side state is dropped too: its `CanvasState`
and, when the model has `release_context(req_id)`, the context K/V the model gathered for
its canvases (DiffusionGemma: `diffusion_gemma_context.ContextCache`).

`ModelRunnerOutput.sampled_token_ids[i]` is the committed tokens of request i, or `[]`
(no commit: a canvas step that goes on, or a causal-only step). A new request whose own data
cannot be put in the batch (a seed past 64 bits) is left out of every step and reported in
`ModelRunnerOutput.failed`, as in the autoregressive runner: it ends alone.

Tensor parallelism: every rank runs this runner on the same scheduler outputs and must take
the same steps (the model's all-reduces pair up) and commit the same tokens (the next
encode reads them). All draws are keyed by the request's seed; an unseeded request's seed
is drawn here, from a stream every rank seeds alike (`torch.initial_seed()`, which the
multi-rank executors set to `model.seed` on every rank) when there are several ranks, and
from the OS's entropy on one. Nothing else depends on the rank: the logits are the same
bits on every rank (they follow the all-reduces), so the sampler's choices are too.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker import parallel_state
from tandem.core.worker.block_diffusion import BlockDiffusionModel, DenoiseContext
from tandem.core.worker.diffusion_state import (
    CanvasState,
    DenoiseMetadata,
    DenoiseSamplerOutput,
    DiffusionStates,
    InitialCanvasMetadata,
)
from tandem.core.worker.flat_batch import prepare_flat_batch
from tandem.core.worker.host_tensors import host_int64
from tandem.core.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


class _Group:
    """Requests of one step denoising canvases of the same length, in row order."""

    __slots__ = ("canvas", "logits", "req_ids")

    def __init__(self, req_ids: list[str], canvas: torch.Tensor, logits: torch.Tensor) -> None:
        self.req_ids, self.canvas, self.logits = req_ids, canvas, logits


class DiffusionRunner:
    """Runs block-diffusion steps over a persistent input batch (module docstring)."""

    def __init__(
        self, model: BlockDiffusionModel, hooks: Any, block_size: int, max_num_reqs: int
    ) -> None:
        self.model = model
        self.hooks = hooks
        self.block_size = block_size
        self.input_batch = InputBatch(max_num_reqs=max_num_reqs)
        self.states = DiffusionStates()
        #: Executed, not yet sampled steps: (output, canvas groups, the requests whose
        #: inputs failed in that step with the reason).
        self._pending: list[tuple[SchedulerOutput, list[_Group], dict[str, str]]] = []
        #: Requests whose own inputs could not be prepared: left out of every step until the
        #: scheduler reports them finished (the kernel ends them with their error).
        self._excluded: set[str] = set()
        #: Seeds of unseeded requests: the same stream on every rank (module docstring).
        several = parallel_state.current().world_size > 1
        self._seeds = random.Random(torch.initial_seed() if several else None)

    # Executing a step ----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> dict[str, str]:
        """Apply the step's request changes. A new request whose own data cannot be put in
        the batch is left out and returned as {id: reason}; the others go on."""
        ib = self.input_batch
        release = getattr(self.model, "release_context", None)  # optional on the model
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            ib.remove(req_id)
            self.states.forget(req_id)  # a preempted request restarts its canvas
            self._excluded.discard(req_id)
            if release is not None:
                release(req_id)  # its blocks may be reused or recomputed
        failed: dict[str, str] = {}
        for new in so.scheduled_new_reqs:
            try:
                if new.input_error is not None:
                    raise ValueError(new.input_error)
                ib.add_new(new)
                params = new.sampling_params
                eos = () if params.ignore_eos or new.eos_token_id is None else (new.eos_token_id,)
                seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
                self.states.admit(
                    new.req_id,
                    seed,
                    eos,
                    len(new.token_ids) - new.num_prompt_tokens,
                    self.model.canvas_length,
                )
            except Exception as exc:  # this request's own data: end it alone
                ib.remove(new.req_id)
                self.states.forget(new.req_id)
                failed[new.req_id] = f"input preparation failed: {type(exc).__name__}: {exc}"
                logger.warning("request %s: %s", new.req_id, failed[new.req_id])
        self._excluded.update(failed)
        for cached in so.scheduled_cached_reqs:
            if cached.req_id in self._excluded:
                continue
            row = ib.req_id_to_row[cached.req_id]
            own = int(ib.num_computed_tokens[row])
            if cached.num_computed_tokens != own:
                raise AssertionError(
                    f"request {cached.req_id}: the scheduler's num_computed_tokens "
                    f"{cached.num_computed_tokens} is not the worker's {own}"
                )
            ib.block_table.append(row, cached.new_block_ids)
        ib.condense()
        return failed

    def execute_model(self, so: SchedulerOutput) -> None:
        failed = self._update_states(so)
        canvases = so.scheduled_spec_decode_tokens
        row_of = self.input_batch.req_id_to_row
        running = [r for r in so.num_scheduled_tokens if r not in self._excluded]
        order = sorted(running, key=row_of.__getitem__)
        causal = {r: so.num_scheduled_tokens[r] - len(canvases.get(r, ())) for r in order}
        self._encode([r for r in order if causal[r] > 0], causal)
        groups = self._denoise([r for r in order if r in canvases], canvases)
        self._pending.append((so, groups, failed))

    def _encode(self, req_ids: list[str], counts: dict[str, int]) -> None:
        """One causal pass over the prompt chunks and committed canvases of `req_ids`."""
        if not req_ids:
            return
        ib = self.input_batch
        rows = [ib.req_id_to_row[r] for r in req_ids]
        batch = prepare_flat_batch(
            ib, req_ids, rows, [counts[r] for r in req_ids], {}, self.block_size, self.model.device
        )
        self.model.encode(batch)

    def _denoise(self, req_ids: list[str], canvases: dict[str, list[int]]) -> list[_Group]:
        """One decoder pass per canvas length over the requests denoising this step."""
        by_length: dict[int, list[str]] = {}
        for req_id in req_ids:
            by_length.setdefault(len(canvases[req_id]), []).append(req_id)
        groups = []
        for length, group in by_length.items():
            self._start_canvases(group, length)
            groups.append(self._denoise_group(group))
        return groups

    def _start_canvases(self, req_ids: list[str], length: int) -> None:
        """Draw the initial canvas of every request in `req_ids` at its canvas's first step."""
        starting = [r for r in req_ids if self.states[r].canvas is None]
        if not starting:
            return
        states = [self.states[r] for r in starting]
        metadata = InitialCanvasMetadata(
            seeds=[s.seed for s in states],
            canvas_indices=[s.canvas_index for s in states],
            canvas_length=length,
            vocab_size=self.model.vocab_size,
        )
        empty = torch.empty(0, device=self.model.device)
        with torch.inference_mode():
            initial = self.hooks.sample(logits=empty, metadata=metadata)
        if not isinstance(initial, torch.Tensor):
            raise RuntimeError(
                "no plugin drew the initial canvas: the stack needs a denoising sampler"
            )
        for state, canvas in zip(states, initial, strict=True):
            state.start_canvas(canvas)

    def _denoise_group(self, req_ids: list[str]) -> _Group:
        ib = self.input_batch
        rows = [ib.req_id_to_row[r] for r in req_ids]
        index = host_int64(rows)
        context_lens = ib.num_computed_tokens[index]
        if not torch.equal(context_lens, ib.num_tokens[index]):
            raise AssertionError(f"denoising {req_ids} before their context is encoded")
        states = [self.states[r] for r in req_ids]
        canvas = torch.stack([s.canvas for s in states])  # type: ignore[misc]
        has_self_cond = [s.self_cond is not None for s in states]
        self_cond = None
        if any(has_self_cond):
            template = next(s.self_cond for s in states if s.self_cond is not None)
            self_cond = torch.stack(
                [
                    s.self_cond if s.self_cond is not None else torch.zeros_like(template)
                    for s in states
                ]
            )
        device = self.model.device
        context = DenoiseContext(
            req_ids=list(req_ids),
            block_tables=ib.block_table.gather(index, rows).to(device),
            context_lens=context_lens.to(device),
            has_self_cond=torch.tensor(has_self_cond, dtype=torch.bool, device=device),
            block_size=self.block_size,
        )
        with torch.inference_mode():
            logits = self.model.denoise(canvas, self_cond, context)
        return _Group(list(req_ids), canvas, logits)

    # Sampling a step -----------------------------------------------------------------------
    def sample_tokens(self, grammar_bitmask: torch.Tensor | None = None) -> ModelRunnerOutput:
        so, groups, failed = self._pending.pop(0)
        committed: dict[str, list[int]] = {}
        for group in groups:
            committed.update(self._sample_group(group))
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[committed.get(r, []) for r in req_ids],
            failed=failed,
        )

    def _sample_group(self, group: _Group) -> dict[str, list[int]]:
        states = [self.states[r] for r in group.req_ids]
        device = group.logits.device
        metadata = DenoiseMetadata(
            req_ids=group.req_ids,
            canvas=group.canvas,
            step_index=torch.tensor(
                [s.step_index for s in states], dtype=torch.int64, device=device
            ),
            prev_argmax=torch.stack([s.prev_argmax for s in states]),  # type: ignore[misc]
            stable_run=torch.tensor(
                [s.stable_run for s in states], dtype=torch.int64, device=device
            ),
            seeds=[s.seed for s in states],
            canvas_indices=[s.canvas_index for s in states],
            eos_token_ids=[s.eos_token_ids for s in states],
        )
        with torch.inference_mode():
            result = self.hooks.sample(logits=group.logits, metadata=metadata)
        if not isinstance(result, DenoiseSamplerOutput):
            raise RuntimeError("no plugin answered the denoising `sample`: add 'diffusion-sampler'")
        return self._apply(group.req_ids, states, result)

    def _apply(
        self, req_ids: list[str], states: list[CanvasState], result: DenoiseSamplerOutput
    ) -> dict[str, list[int]]:
        """Advance or commit each row's state; append committed tokens to its history."""
        committed: dict[str, list[int]] = {}
        runs = result.stable_run.tolist()
        for i, (req_id, state) in enumerate(zip(req_ids, states, strict=True)):
            tokens = result.committed[i]
            if not tokens:
                state.advance(
                    result.canvas[i], result.processed_logits[i], result.argmax_canvas[i], runs[i]
                )
                continue
            state.committed()
            committed[req_id] = tokens
            self._append_history(req_id, tokens)
        return committed

    def _append_history(self, req_id: str, tokens: list[int]) -> None:
        ib = self.input_batch
        row = ib.req_id_to_row[req_id]
        start = int(ib.num_tokens[row])
        ib.ensure_width(start + len(tokens))
        ib.token_ids[row, start : start + len(tokens)] = host_int64(tokens)
        ib.num_tokens[row] = start + len(tokens)
