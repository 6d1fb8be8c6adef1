"""The engine loop. `step()` and `step_with_batch_queue()` are twins: read them side by side.

`step()` runs one step to completion: schedule, execute, sample, update. With async
scheduling the kernel uses `step_with_batch_queue()`, which keeps up to
`max_concurrent_batches` steps in flight: it queues a step and returns at once while the
queue has room, and blocks on the oldest step only when the queue is full or nothing else
can be scheduled. Aborts are drained before every `update_from_output`. When the scheduler
sets `pending_structured_output_tokens`, sampling of that step waits until the previous
step's tokens are applied.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext

from tandem.core.config import EngineConfig
from tandem.core.executor import Executor, make_executor
from tandem.core.hook_timing import HookTimer
from tandem.core.invariants import check_invariants
from tandem.core.model_runner_output import ModelRunnerOutput, resolve_output
from tandem.core.outputs import EngineCoreOutput
from tandem.core.plugin_manager import TandemPluginManager
from tandem.core.request import Request, RequestRejectedError, RequestStatus
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.scheduler_state import SchedulerState
from tandem.core.step_trace import StepTracer
from tandem.sampling_params import SamplingParams, validate_for_model

logger = logging.getLogger("tandem.engine")

QueuedStep = tuple[Future, SchedulerOutput, Future]


class EngineDeadError(RuntimeError):
    """The engine stopped after a step failed in a way no single request explains (the
    forward pass, the scheduler or a plugin's bookkeeping raised). Every request it held
    ended with `finish_reason == "error"`; it accepts no new work. Create a new engine."""


class EngineCore:
    """Owns the loop, the batch queue, the aborts queue, the executor and the output path.

    The scheduler plugin owns the queues, the requests and the KV cache manager; the kernel
    only talks to it through hooks. `config` must be resolved (`resolve_config`).
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        vocab_size: int | None = None,
        source: str | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.vocab_size = vocab_size if vocab_size is not None else config.model.vocab_size
        self.plugin_manager = TandemPluginManager(
            config, side="engine", source=source if source is not None else config.source
        )
        self.hook = self.plugin_manager.hook
        self.executor = executor if executor is not None else make_executor(config)
        self.batch_queue_size = config.max_concurrent_batches
        self.batch_queue: deque[QueuedStep] = deque()
        self._aborts: deque[str] = deque()
        self._aborts_lock = threading.Lock()
        self._live: set[str] = set()
        self.step_fn = self.step_with_batch_queue if self.batch_queue_size > 1 else self.step
        self.num_steps = 0
        #: Why the engine stopped (`run_step` contained a failed step), or None while alive.
        self.dead_error: str | None = None
        #: Set a `StepTracer` to record engine spans (`tandem trace`); None costs nothing.
        self.tracer: StepTracer | None = None
        #: Per-plugin hook timing when `config.trace_hooks` (`HookTimer.summary`).
        self.hook_timer = HookTimer().install(self.plugin_manager) if config.trace_hooks else None
        worker = getattr(self.executor, "worker", None)  # in-process and thread executors
        if self.hook_timer is not None and worker is not None:
            self.hook_timer.install(worker.plugin_manager)  # `sample`, `propose_drafts`

    def _span(self, name: str) -> AbstractContextManager[None]:
        if self.hook_timer is not None:  # hook calls inside this span belong to this step
            self.hook_timer.tracer = self.tracer
            self.hook_timer.step_id = self.num_steps
        return self.tracer.span("engine", name) if self.tracer is not None else nullcontext()

    # Requests -------------------------------------------------------------------------
    def validate_request(self, request: Request) -> None:
        """Reject what no step could run; the message names the field."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if not isinstance(request.sampling_params, SamplingParams):
            raise TypeError("sampling_params: expected a tandem.SamplingParams")
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {request.request_id}: prompt: must not be empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt: {n} tokens is too long; "
                f"max_model_len is {self.max_model_len} and at least one position must be "
                f"left for output"
            )
        ids = request.prompt_token_ids
        if not all(isinstance(t, int) for t in ids):
            raise ValueError(f"request {request.request_id}: prompt_token_ids: expected integers")
        if self.vocab_size is not None and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise ValueError(
                f"request {request.request_id}: prompt_token_ids: token id {bad} is "
                f"outside the vocabulary [0, {self.vocab_size})"
            )
        validate_for_model(request.sampling_params, self.vocab_size, self.config.model.max_logprobs)
        if request.use_structured_output and not self.plugin_manager.plugins_with_role("grammar"):
            raise RequestRejectedError(
                f"request {request.request_id}: structured_outputs: this engine's stack has no "
                "grammar backend (the scripted model has no tokenizer; with a real model add "
                "the 'structured-output' plugin)"
            )
        if request.request_id in self._live:
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        if any(request.request_id in so.num_scheduled_tokens for _, so, _ in self.batch_queue):
            raise ValueError(
                f"request_id: {request.request_id!r} finished but a step computing it is still "
                f"in flight; reuse the id once that step completes"
            )

    def add_request(self, request: Request) -> None:
        """Validate and hand the request to every plugin. A plugin that rejects it (raises
        ValueError) gets it aborted everywhere; the error goes to this caller only."""
        self.validate_request(request)
        try:
            self.hook.add_request(request=request)
        except Exception:
            self.hook.abort_requests(
                request_ids=[request.request_id], status=RequestStatus.FINISHED_ERROR
            )
            raise
        self._admit(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Thread-safe: queue aborts of the requests live now; they take effect at the next
        drain point. An abort targets the request that has the id when it is called: an id
        not live then (never added, already finished) is ignored, and a request added later
        with the same id is never ended by it (`_admit` drops aborts queued before it)."""
        with self._aborts_lock:
            self._aborts.extend(rid for rid in request_ids if rid in self._live)

    def _admit(self, request_id: str) -> None:
        """Mark a request live. Aborts still queued for its id were queued for an earlier
        request with that id, which finished before they were drained: drop them."""
        with self._aborts_lock:
            if request_id in self._aborts:
                self._aborts = deque(rid for rid in self._aborts if rid != request_id)
            self._live.add(request_id)

    def _process_aborts_queue(self) -> list[EngineCoreOutput]:
        """Drain client aborts, then the requests plugins ended (`poll_finished_requests`).
        An abort for a request that finished after it was queued is dropped."""
        with self._aborts_lock:
            ids = list(dict.fromkeys(rid for rid in self._aborts if rid in self._live))
            self._aborts.clear()
        outputs = []
        if ids:
            self.hook.abort_requests(request_ids=ids, status=RequestStatus.FINISHED_ABORTED)
            self._live.difference_update(ids)
            outputs = [
                EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="abort")
                for rid in ids
            ]
        for finishes in self.hook.poll_finished_requests():
            for finish in finishes or ():
                if finish.request_id not in self._live:
                    continue
                status = (
                    RequestStatus.FINISHED_ERROR
                    if finish.finish_reason == "error"
                    else RequestStatus.FINISHED_STOPPED
                )
                self.hook.abort_requests(request_ids=[finish.request_id], status=status)
                self._live.discard(finish.request_id)
                outputs.append(
                    EngineCoreOutput(
                        request_id=finish.request_id,
                        new_token_ids=[],
                        finish_reason=status.finish_reason,
                        error=finish.error,
                    )
                )
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.dead_error is None and bool(self.hook.has_unfinished_requests())

    def has_work(self) -> bool:
        """Requests to run, steps in flight or aborts to report (never, once dead)."""
        if self.dead_error is not None:
            return False
        return self.has_unfinished_requests() or bool(self.batch_queue) or bool(self._aborts)

    @property
    def scheduler_state(self) -> SchedulerState:
        return self.hook.scheduler_state()

    # The loop: step() and step_with_batch_queue() are twins ----------------------------
    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """Schedule, execute, sample and update one step. Returns (outputs, model_executed)."""
        outputs = self._process_aborts_queue()
        if not self.has_unfinished_requests():
            return outputs, False
        with self._span("schedule"):
            scheduler_output = self.hook.schedule()
            self.hook.update_after_schedule(scheduler_output=scheduler_output)
        exec_future = self.executor.execute_model(scheduler_output)
        grammar_bitmask = self.hook.grammar_bitmask(scheduler_output=scheduler_output)
        future = self.executor.sample_tokens(grammar_bitmask)
        model_executed = scheduler_output.total_num_scheduled_tokens > 0

        with self._span("wait"):
            exec_future.result()
            model_output = resolve_output(future.result())
        outputs += self._process_aborts_queue()
        with self._span("update"):
            outputs += self._update_from_output(scheduler_output, model_output)
        return outputs, model_executed

    def step_with_batch_queue(self) -> tuple[list[EngineCoreOutput], bool]:
        """Queue a step and return while there is room; otherwise finish the oldest step."""
        outputs = self._process_aborts_queue()
        batch_queue = self.batch_queue
        deferred: tuple[SchedulerOutput, Future] | None = None
        model_executed = False
        if self.has_unfinished_requests():
            with self._span("schedule"):
                scheduler_output = self.hook.schedule()
                self.hook.update_after_schedule(scheduler_output=scheduler_output)
            exec_future = self.executor.execute_model(scheduler_output)
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            if not scheduler_output.pending_structured_output_tokens:
                grammar_bitmask = self.hook.grammar_bitmask(scheduler_output=scheduler_output)
                future = self.executor.sample_tokens(grammar_bitmask)
                batch_queue.appendleft((future, scheduler_output, exec_future))
                if len(batch_queue) < self.batch_queue_size and (
                    model_executed or self.has_unfinished_requests()
                ):
                    return outputs, model_executed  # don't block while there is room
            else:
                deferred = (scheduler_output, exec_future)  # sample after the prior step
        if batch_queue:
            future, scheduler_output, exec_future = batch_queue.pop()
            with self._span("wait"):
                exec_future.result()
                model_output = resolve_output(future.result())
            outputs += self._process_aborts_queue()
            with self._span("update"):
                outputs += self._update_from_output(scheduler_output, model_output)
        if deferred is not None:
            scheduler_output, exec_future = deferred
            grammar_bitmask = self.hook.grammar_bitmask(scheduler_output=scheduler_output)
            future = self.executor.sample_tokens(grammar_bitmask)
            batch_queue.appendleft((future, scheduler_output, exec_future))
        return outputs, model_executed

    def _update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        failed = self._fail_requests(model_output.failed)
        results = self.hook.update_from_output(
            scheduler_output=scheduler_output, model_runner_output=model_output
        )
        answers = [r for r in results if r is not None]
        if len(answers) != 1:
            raise RuntimeError(
                f"update_from_output: exactly one plugin (the scheduler) must return outputs, "
                f"{len(answers)} did"
            )
        outputs: list[EngineCoreOutput] = failed + answers[0]
        for out in outputs:
            if out.finish_reason is not None:
                self._live.discard(out.request_id)
        self.num_steps += 1
        if self.config.check_invariants:
            state = self.scheduler_state
            kv = state.kv_cache_manager
            # Idle only when no step is in flight, counting one whose sampling was deferred
            # (it is not back in the batch queue yet, but its fence is still open).
            idle = (
                not self.has_unfinished_requests()
                and not self.batch_queue
                and kv.processed_step_seq == kv.scheduled_step_seq
            )
            check_invariants(state, self.num_steps, idle)
        return outputs

    def _fail_requests(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """End the requests whose own processing failed in the worker (`errors`: id ->
        reason) with `finish_reason == "error"`, exactly like an abort: the scheduler frees
        their KV through the fence and skips their results."""
        ids = [rid for rid in errors if rid in self._live]
        if not ids:
            return []
        self.hook.abort_requests(request_ids=ids, status=RequestStatus.FINISHED_ERROR)
        self._live.difference_update(ids)
        return [
            EngineCoreOutput(
                request_id=rid, new_token_ids=[], finish_reason="error", error=errors[rid]
            )
            for rid in ids
        ]

    def run_step(self) -> tuple[list[EngineCoreOutput], bool]:
        """`step_fn` for front doors: a step that raises (the forward pass, the scheduler,
        a plugin's bookkeeping: nothing one request explains) stops the engine instead of
        leaving requests RUNNING with no way forward. Every live request then ends with
        `finish_reason == "error"` naming the failure, `has_work()` turns False and
        `add_request` raises `EngineDeadError`. Per-request failures never get here: the
        worker isolates them (`ModelRunnerOutput.failed`)."""
        if self.dead_error is not None:
            return [], False
        try:
            return self.step_fn()
        except Exception as exc:
            logger.exception("engine step %d failed; stopping the engine", self.num_steps)
            return self._die(exc), False

    def _die(self, exc: Exception) -> list[EngineCoreOutput]:
        reason = (
            f"the engine stopped: step {self.num_steps} failed with {type(exc).__name__}: "
            f"{exc}; create a new engine (LLM) to go on"
        )
        self.dead_error = reason
        live, self._live = sorted(self._live), set()
        self.batch_queue.clear()
        with self._aborts_lock:
            self._aborts.clear()
        try:  # let the plugins drop their state; the engine is dead either way
            self.hook.abort_requests(request_ids=live, status=RequestStatus.FINISHED_ERROR)
        except Exception:
            logger.exception("abort_requests failed while stopping the engine")
        return [
            EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="error", error=reason)
            for rid in live
        ]

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[EngineCoreOutput]:
        """Step until nothing is waiting, running or in flight; return every output."""
        outputs: list[EngineCoreOutput] = []
        for _ in range(max_steps):
            if not self.has_work():
                return outputs
            step_outputs, _ = self.step_fn()
            outputs.extend(step_outputs)
        raise RuntimeError(f"engine did not become idle within {max_steps} steps")

    def shutdown(self) -> None:
        self.executor.shutdown()
