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
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from tandem.core.clock import WALL_CLOCK, Clock
from tandem.core.executor import Executor, make_executor
from tandem.core.live_requests import LiveRequests
from tandem.core.model_runner_output import ModelRunnerOutput, resolve_output
from tandem.core.outputs import EngineCoreOutput
from tandem.core.plugin_manager import TandemPluginManager, import_class
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.scheduler_state import SchedulerState
from tandem.schema.config import EngineConfig
from tandem.schema.request_checks import check_request

logger = logging.getLogger("tandem.engine")

QueuedStep = tuple[Future, SchedulerOutput, Future]

#: Longest an idle engine lets plugins block in `wait_for_work` (new requests and aborts
#: are picked up after it).
IDLE_WAIT_S = 0.005


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
        source: str | None = None,
        clock: Clock = WALL_CLOCK,
    ) -> None:
        self.config, self.clock = config, clock  # every plugin gets the clock (`plugin.clock`)
        self.max_model_len, self.vocab_size = config.max_model_len, config.model.vocab_size
        source = source if source is not None else config.source
        # The executor first: its ranks may shrink the planned KV pool to what their memory
        # holds (`cache.num_kv_blocks`), which the scheduler's KV manager then gets.
        self.executor = executor if executor is not None else make_executor(config)
        try:
            self.plugin_manager = TandemPluginManager(config, "engine", source, clock)
        except BaseException:
            self.executor.shutdown()
            raise
        self.hook = self.plugin_manager.hook
        self.batch_queue_size = config.max_concurrent_batches
        self.batch_queue: deque[QueuedStep] = deque()
        self.live = LiveRequests(self.hook)
        self.step_fn = self.step_with_batch_queue if self.batch_queue_size > 1 else self.step
        self.num_steps = 0
        #: Why the engine stopped (`run_step` contained a failed step), or None while alive.
        self.dead_error: str | None = None
        #: The exception that stopped it: a `PluginError` naming the plugin, the hook and
        #: the step when a hook implementation raised, else the exception as raised.
        self.dead_exception: BaseException | None = None
        #: Wraps each wait for a step's results, the one part of a step that is no hook
        #: call (the tracing plugin times it); returns a context manager.
        self.wait_observer: Callable[[], AbstractContextManager[None]] | None = None
        for path in config.attached_plugins:  # cross-cutting plugins on wrapper hooks
            import_class(path).attach(self)

    # Requests -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Validate (`check_request`, then the ids this engine holds; messages name the
        field) and hand the request to every plugin. A plugin that rejects it (raises
        ValueError) gets it aborted everywhere; the error goes to this caller only. Any
        other exception from a plugin's `add_request` is raised as a `PluginError` naming
        the plugin (the request is aborted everywhere; the engine goes on)."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        check_request(request, self.config, bool(self.plugin_manager.plugins_with_role("grammar")))
        rid = request.request_id
        if rid in self.live:
            raise ValueError(f"request_id: {rid!r} is already in the engine")
        if any(rid in so.num_scheduled_tokens for _, so, _ in self.batch_queue):
            raise ValueError(
                f"request_id: {rid!r} finished but a step computing it is still in flight; "
                f"reuse the id once that step completes"
            )
        try:
            self.hook.add_request(request=request)
        except Exception as exc:
            self.hook.abort_requests(request_ids=[rid], status=RequestStatus.FINISHED_ERROR)
            if isinstance(exc, ValueError):  # a rejection (the contract): this request's own
                raise
            phase = f"add_request of request {rid!r} (after {self.num_steps} engine steps)"
            failure = self.plugin_manager.plugin_error(exc, phase)
            if failure is None:
                raise
            raise failure from exc
        self.live.admit(rid)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Thread-safe: queue aborts of the requests live now (`LiveRequests`); they take
        effect at the next drain point, before the next schedule or update."""
        self.live.queue_aborts(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.dead_error is None and bool(self.hook.has_unfinished_requests())

    def has_work(self) -> bool:
        """Requests to run, steps in flight or aborts to report (never, once dead)."""
        if self.dead_error is not None:
            return False
        return self.has_unfinished_requests() or bool(self.batch_queue) or self.live.has_aborts()

    @property
    def scheduler_state(self) -> SchedulerState:
        return self.hook.scheduler_state()

    def stats(self) -> dict[str, Any]:
        """Every plugin's `engine_stats` merged, with `batch_queue_depth` (steps in flight)."""
        merged = {k: v for part in self.hook.engine_stats() if part for k, v in part.items()}
        return merged | {"batch_queue_depth": len(self.batch_queue)}

    # The loop: step() and step_with_batch_queue() are twins ----------------------------
    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """Schedule, execute, sample and update one step. Returns (outputs, model_executed)."""
        outputs = self.live.drain_aborts()
        if not self.has_unfinished_requests():
            return outputs, False
        scheduler_output = self.hook.schedule()
        self.hook.update_after_schedule(scheduler_output=scheduler_output)
        exec_future = self.executor.execute_model(scheduler_output)
        grammar_bitmask = self.hook.grammar_bitmask(scheduler_output=scheduler_output)
        future = self.executor.sample_tokens(grammar_bitmask)
        model_executed = scheduler_output.total_num_scheduled_tokens > 0

        with self._waiting():
            exec_future.result()
            model_output = resolve_output(future.result())
        outputs += self.live.drain_aborts()
        outputs += self._update_from_output(scheduler_output, model_output)
        if not model_executed:
            self._wait_for_work()
        return outputs, model_executed

    def step_with_batch_queue(self) -> tuple[list[EngineCoreOutput], bool]:
        """Queue a step and return while there is room; otherwise finish the oldest step."""
        outputs = self.live.drain_aborts()
        batch_queue = self.batch_queue
        deferred: tuple[SchedulerOutput, Future] | None = None
        model_executed = False
        if self.has_unfinished_requests():
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
            with self._waiting():
                exec_future.result()
                model_output = resolve_output(future.result())
            outputs += self.live.drain_aborts()
            outputs += self._update_from_output(scheduler_output, model_output)
            if not scheduler_output.total_num_scheduled_tokens:
                self._wait_for_work()
        if deferred is not None:
            scheduler_output, exec_future = deferred
            grammar_bitmask = self.hook.grammar_bitmask(scheduler_output=scheduler_output)
            future = self.executor.sample_tokens(grammar_bitmask)
            batch_queue.appendleft((future, scheduler_output, exec_future))
        return outputs, model_executed

    def _waiting(self) -> AbstractContextManager[None]:
        return self.wait_observer() if self.wait_observer is not None else nullcontext()

    def _update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        # Requests whose own processing failed in the worker end first, with their error.
        failed = list(model_output.failed)
        outputs = self.live.end(failed, RequestStatus.FINISHED_ERROR, model_output.failed)
        results = self.hook.update_from_output(
            scheduler_output=scheduler_output, model_runner_output=model_output
        )
        answers = [r for r in results if r is not None]
        if len(answers) != 1:
            raise RuntimeError(
                f"update_from_output: exactly one plugin (the scheduler) must return outputs, "
                f"{len(answers)} did"
            )
        outputs += answers[0]
        self.live.discard(out.request_id for out in outputs if out.finish_reason is not None)
        self.num_steps += 1
        return outputs

    def _wait_for_work(self) -> None:
        """After a step that scheduled nothing: with requests unfinished and no step with
        tokens in flight, every request left waits for a plugin; let plugins block until
        they have news (`wait_for_work`) instead of spinning through empty steps."""
        if self.has_unfinished_requests() and not any(
            so.total_num_scheduled_tokens for _, so, _ in self.batch_queue
        ):
            self.hook.wait_for_work(timeout_s=IDLE_WAIT_S)

    def run_step(self) -> tuple[list[EngineCoreOutput], bool]:
        """`step_fn` for front doors: a step that raises (the forward pass, the scheduler,
        a plugin's bookkeeping: nothing one request explains) stops the engine instead of
        leaving requests RUNNING with no way forward. Every live request then ends with
        `finish_reason == "error"` naming the failure, `has_work()` turns False and
        `add_request` raises `EngineDeadError`. When a hook implementation raised, the
        message (`dead_error`) and `dead_exception` are a `PluginError` naming the plugin,
        the hook, its `file:line` and the step. Per-request failures never get here: the
        worker isolates them (`ModelRunnerOutput.failed`)."""
        if self.dead_error is not None:
            return [], False
        try:
            return self.step_fn()
        except Exception as exc:
            step = self.num_steps
            failure = self.plugin_manager.plugin_error(exc, f"engine step {step}", step)
            logger.exception("engine step %d failed; stopping the engine", step)
            self.dead_exception = failure or exc
            self.dead_error = (
                f"the engine stopped: {failure}"
                if failure is not None
                else f"the engine stopped: step {step} failed with {type(exc).__name__}: {exc}"
            ) + "; create a new engine (LLM) to go on"
        live = self.live.clear()
        self.batch_queue.clear()
        try:  # let the plugins drop their state; the engine is dead either way
            self.hook.abort_requests(request_ids=live, status=RequestStatus.FINISHED_ERROR)
        except Exception:
            logger.exception("abort_requests failed while stopping the engine")
        return [EngineCoreOutput.ended(rid, "error", self.dead_error) for rid in live], False

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
