"""The diffusion scheduler: block-diffusion requests on the reference scheduler's ledger.

A subclass of `ReferenceScheduler` that overrides only what differs. A block-diffusion
model (`core/worker/block_diffusion.py`) samples nothing from causal positions
(`num_sampled_tokens_per_step = 0`); it denoises a canvas of L positions per request and
step, and every so often commits it. The canvas travels on the speculative-decoding path.

The ledger, per step (L = `diffusion.canvas_length`; C = the request's uncomputed known
tokens: prompt not yet prefilled, or the last commit not yet encoded):

1. `schedule`: every RUNNING request without a step in flight gets `spec_token_ids =
   [CANVAS_PLACEHOLDER] * L'`, `L' = min(L, max_model_len - num_tokens)` (the canvas shrinks
   only at the model-length edge). Its work is C causal tokens (clamped as a prefill chunk:
   budget, `long_prefill_token_threshold`, `max_model_len`) plus, only when all C fit, the
   L' canvas positions *all or nothing*: a canvas is never chunked; when the budget cannot
   take it, it waits a step. So the last prefill chunk (or the encode of a commit) is fused
   with the next canvas's denoising step whenever the budget allows. WAITING requests are
   admitted as usual, their prompt only (their first canvas comes with their next step).
2. `update_after_schedule` (reference): `num_computed_tokens += C + L'`; blocks are
   allocated for the canvas slots too. Prefix caching registers only blocks full of *known*
   tokens (`KVCacheManager` caps at `num_tokens`), so canvas slots are never cached; the
   committed tokens' blocks are cached when their encode pass is scheduled, like prompts.
3. `update_from_output`: all L' canvas positions are rejected (`num_computed_tokens -=
   L'`, nothing appended); when the runner reports a commit for the request (a non-empty
   `sampled_token_ids` row: the argmax canvas, trimmed after its first EOS by the runner),
   those tokens are appended one at a time with `check_stop` (max_tokens, max_model_len,
   EOS, stop tokens; trimmed at the stop). They are *not* computed: step 1 of the next
   step schedules them causally, and the encoder writes their KV.

Prompts prefill as usual (budget, `max_num_seqs`, chunked prefill, priority, preemption by
recompute, prefix caching). A preempted request loses its canvas and the runner's state for
it (canvas, self-conditioning logits, stability state, step index) and restarts that
canvas after recompute; draws are keyed by (seed, canvas index, step), so the restart
repeats them.

Async scheduling (`async_scheduling: true`, the stock async layer): the layer adds
`num_sampled_tokens_per_step (0) + scheduled spec` = L' placeholders, so only the canvas
positions get placeholders. Differences from AR async: a request whose denoising step is in
flight (`num_output_placeholders > 0`) is not scheduled again until that step's result is
in, since its next step depends on whether it committed; other requests fill the batch, so
the batch queue of 2 still overlaps steps of different requests (and the prefill chunks of
one request, which carry no placeholders). A result resolves the L' placeholders with the
rejection (`num_output_placeholders -= L'`). Fence, aborts, stale results after preemption
(`num_stale_output_tokens`): the reference rules, unchanged.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from tandem.core import hookimpl
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.outputs import EngineCoreOutput
from tandem.core.plugin_manager import PluginConfigError
from tandem.core.request import Request
from tandem.core.scheduler_output import SchedulerOutput
from tandem.plugins.reference_scheduler import ReferenceScheduler
from tandem.plugins.stop_check import check_stop
from tandem.schema.config import EngineConfig

#: The spec-token id of a canvas position in the ledger; the runner keeps the real canvas.
CANVAS_PLACEHOLDER = -1


class DiffusionStats:
    """Counters for `engine_stats` / `tandem bench`: denoising steps, commits, tokens."""

    def __init__(self) -> None:
        self.denoising_steps = 0
        self.commits = 0
        self.committed_tokens = 0
        self.engine_steps = 0

    def render(self) -> dict[str, float | int]:
        return {
            "denoising_steps": self.denoising_steps,
            "commits": self.commits,
            "committed_tokens": self.committed_tokens,
            "engine_steps": self.engine_steps,
            "denoising_steps_per_canvas": self.denoising_steps / max(self.commits, 1),
            "committed_tokens_per_step": self.committed_tokens / max(self.engine_steps, 1),
            # One request's denoising step is one decoder forward over its canvas.
            "tokens_per_forward": self.committed_tokens / max(self.denoising_steps, 1),
        }


class DiffusionScheduler(ReferenceScheduler):
    """The reference scheduler with canvases as spec tokens (see the module docstring)."""

    role = "scheduler"
    default_for_role = False
    #: The default of its role for block-diffusion models (`config_resolution`).
    diffusion_default = True
    num_sampled_tokens_per_step = 0

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        diffusion = getattr(config, "diffusion", None)
        if diffusion is None or diffusion.canvas_length is None:
            raise PluginConfigError(
                "diffusion-scheduler: needs a diffusion model (a resolved `diffusion` "
                "section with canvas_length); this model is autoregressive"
            )
        self.canvas_length: int = diffusion.canvas_length
        self.diffusion_stats = DiffusionStats()

    # Scheduling -------------------------------------------------------------------------
    @hookimpl
    def schedule(self) -> SchedulerOutput:
        for request in self.running:
            if request.num_output_placeholders == 0:
                room = self.max_model_len - request.num_tokens
                request.spec_token_ids = [CANVAS_PLACEHOLDER] * max(
                    min(self.canvas_length, room), 0
                )
        output = super().schedule()
        if output.total_num_scheduled_tokens:
            self.diffusion_stats.engine_steps += 1
        return output

    def _num_new_tokens(self, request: Request, token_budget: int, num_computed: int) -> int:
        """C causal tokens clamped as a prefill chunk, plus the whole canvas only when all
        C are scheduled and the canvas fits too (never chunked)."""
        causal = request.num_tokens - num_computed
        room = self.max_model_len - num_computed
        chunk = min(causal, token_budget, room)
        if 0 < self.long_prefill_token_threshold < chunk:
            chunk = self.long_prefill_token_threshold
        if chunk < causal:
            return chunk
        canvas = len(request.spec_token_ids)
        if canvas and causal + canvas <= min(token_budget, room):
            return causal + canvas
        return causal

    def _sits_out(self, request: Request) -> bool:
        """Async: a request whose denoising step is in flight waits for its result (its
        next step depends on whether it committed)."""
        return request.num_output_placeholders > 0

    def _samples_last_output_token(self, request: Request) -> bool:
        """Canvas positions are not drafts: max_tokens never drops them (the commit is
        trimmed instead)."""
        return False

    # Results ----------------------------------------------------------------------------
    def _commit(self, request: Request, tokens: list[int]) -> tuple[list[int], bool]:
        """Append committed tokens one at a time with a stop check; trim after a stop.
        They stay uncomputed: the next step encodes them."""
        for num_kept, token_id in enumerate(tokens, 1):
            request.append_output_token_ids(token_id)
            if check_stop(request, self.max_model_len):
                return tokens[:num_kept], True
        return tokens, False

    def _resolve_step(self, request: Request, num_tokens: int, canvas: int) -> bool:
        """Roll the step's canvas back; False when the result is stale (dropped)."""
        if request.num_stale_output_tokens > 0:
            request.num_stale_output_tokens -= num_tokens
            assert request.num_stale_output_tokens >= 0, request.ledger()
            return False
        request.num_in_flight_tokens -= num_tokens
        if canvas:
            request.num_computed_tokens -= canvas
            if request.num_output_placeholders > 0:
                request.num_output_placeholders -= canvas
                assert request.num_output_placeholders >= 0, request.ledger()
            self.diffusion_stats.denoising_steps += 1
        return True

    @hookimpl
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        canvases = scheduler_output.scheduled_spec_decode_tokens
        any_stopped = False
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # finished or aborted while this step was in flight
            canvas = len(canvases.get(request_id, ()))
            if not self._resolve_step(request, num_tokens, canvas) or not canvas:
                continue
            index = model_runner_output.req_id_to_index.get(request_id)
            committed = model_runner_output.sampled_token_ids[index] if index is not None else []
            if not committed:
                continue
            new_token_ids, stopped = self._commit(request, list(committed))
            self.diffusion_stats.commits += 1
            self.diffusion_stats.committed_tokens += len(new_token_ids)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
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

    @hookimpl
    def engine_stats(self) -> dict[str, object]:
        return {**self.stats.render(self), "diffusion": self.diffusion_stats.render()}
