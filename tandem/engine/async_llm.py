"""`AsyncLLM`: vLLM's streaming engine client over engine-core processes.

`async for out in engine.generate(prompt, params, request_id)` yields `RequestOutput`s as
the engine resolves tokens, in the request's `output_kind` (CUMULATIVE, DELTA or
FINAL_ONLY); many generators run concurrently on one engine. The engine core runs in its
own process(es) (`core_proc.py`), reached through `EngineCoreClient`; tokenisation,
detokenisation and stop strings stay here, in the front end (`OutputProcessor`).

Contracts:
- Bad input raises ValueError naming the field before anything is sent; a full queue
  raises `QueueFullError`; a dead engine `EngineDeadError` (also into every stream in
  flight, after the outputs already delivered).
- Closing or cancelling a generator before its request finished aborts the request in the
  engine (its KV blocks return through the fence). A consumer more than
  `stream_buffer_size` outputs behind gets `StreamOverflowError` and its request is
  aborted; nobody else waits for it (the output handler never blocks on a consumer).
- Request identity is the front end's: the caller's `request_id` is only a label (it is
  the `request_id` of every output, and `abort(label)` aborts every request in flight under
  it). Each sequence runs in the engine under an internal id `"{label}-{serial}"` whose
  serial this `AsyncLLM` never hands out twice, so no two sequences ever share an engine id
  whatever labels clients choose (duplicates, `{j}_{id}` shapes, a label reused while the
  engine still drains the abort of its previous request), and an output is delivered only
  to the generator whose sequence produced it.
- `n > 1` runs n sequences on one engine (they share the prompt's KV through prefix
  caching); each yielded output holds the sequences that changed (DELTA) or all of them
  (CUMULATIVE; FINAL_ONLY once all finished), each with its `index`.
- With `data_parallel_size = N` there are N engine cores, each with its own worker and KV
  pool; a request goes to the engine with the least load: its requests in flight here
  plus three times the WAITING requests it last reported (`engine_stats`).
- Liveness: every engine core sends a heartbeat while it has nothing else to say;
  `is_healthy()` is False once an engine is dead, restarting, silent for
  `heartbeat_timeout_s` (frozen, e.g. SIGSTOP) or busy without finishing a step for
  `stall_timeout_s`.
- Restarts: with `max_engine_restarts = R > 0`, an engine-core death ends the requests in
  flight with `EngineDeadError` (their KV, prefix cache and any plugin state die with the
  process) and the engine cores are started again with the same configuration; requests
  that arrive meanwhile wait for the new engine. After R restarts the next death is final
  (`wait_dead` returns). `restarts` counts them.
- Thread affinity: call every method from one event loop's thread (the one running the
  generators); `shutdown` from anywhere.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.config_resolution import resolve_config
from tandem.core.executor import executor_class
from tandem.core.plugin_manager import stack_of
from tandem.core.worker.model_loader import model_loader_for
from tandem.engine.core_client import EngineCoreClient
from tandem.engine.errors import EngineDeadError, QueueFullError
from tandem.engine.liveness import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
    EngineLiveness,
)
from tandem.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreDead,
    EngineCoreHeartbeat,
    EngineCoreOutputs,
)
from tandem.engine.request_stream import RequestStream
from tandem.engine.stats import IterationStats, RequestTimings, StatLogger
from tandem.generation_defaults import load_generation_defaults
from tandem.llm_inputs import PromptType
from tandem.output_processor import OutputProcessor
from tandem.request_builder import RequestBuilder
from tandem.schema.config import EngineConfig
from tandem.schema.outputs import CompletionOutput, RequestOutput
from tandem.schema.request_checks import check_request
from tandem.schema.sampling_params import RequestOutputKind, SamplingParams
from tandem.stack_file import load_config

logger = logging.getLogger("tandem.engine")


@dataclass(slots=True, eq=False)
class _Parent:
    """A user request: its sequences (one, or n, by internal id), the engine running them,
    its stream. `request_id` is the caller's label."""

    request_id: str
    child_ids: list[str]
    engine_index: int
    stream: RequestStream
    output_kind: RequestOutputKind
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)


class AsyncLLM:
    """Streaming generation on engine-core processes. See the module docstring."""

    def __init__(
        self,
        model: str | None = None,
        config: str | Path | EngineConfig | None = None,
        *,
        data_parallel_size: int = 1,
        max_num_waiting: int | None = None,
        stream_buffer_size: int = 1024,
        stat_loggers: Sequence[StatLogger] = (),
        max_engine_restarts: int = 0,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        **overrides: Any,
    ) -> None:
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size: expected >= 1, got {data_parallel_size}")
        if max_num_waiting is not None and max_num_waiting < 0:
            raise ValueError(f"max_num_waiting: expected >= 0, got {max_num_waiting}")
        if stream_buffer_size < 1:
            raise ValueError(f"stream_buffer_size: expected >= 1, got {stream_buffer_size}")
        if max_engine_restarts < 0:
            raise ValueError(f"max_engine_restarts: expected >= 0, got {max_engine_restarts}")
        for name, value in (
            ("heartbeat_timeout_s", heartbeat_timeout_s),
            ("stall_timeout_s", stall_timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"{name}: expected > 0, got {value}")
        user_config = load_config(config, model=model, **overrides)
        executor_cls = executor_class(user_config.parallel.executor)
        supports_async = executor_cls.supports_async_scheduling if executor_cls else False
        self.config = resolve_config(user_config, executor_supports_async=supports_async)
        self._has_grammar = bool(stack_of(self.config).with_role("grammar"))
        loader = model_loader_for(self.config.model.model)
        self._generation_defaults = load_generation_defaults(self.config, loader.has_tokenizer)
        self.tokenizer = None
        if loader.has_tokenizer:
            from tandem.models.model_files import load_tokenizer

            self.tokenizer = load_tokenizer(Path(self.config.model.model))
        self.max_model_len: int = self.config.max_model_len
        self.data_parallel_size = data_parallel_size
        self.max_num_waiting = max_num_waiting
        self.stream_buffer_size = stream_buffer_size
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._builder = RequestBuilder(self.config, self.tokenizer)
        self._timings = RequestTimings()
        #: Requests in flight by label; several may share one label.
        self._parents: dict[str, list[_Parent]] = {}
        self._serials = itertools.count()
        self._child_parent: dict[str, tuple[_Parent, int]] = {}
        self._in_flight = [0] * data_parallel_size
        self._engine_stats: list[dict[str, Any] | None] = [None] * data_parallel_size
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_waiters: list[asyncio.Future] = []
        self.dead_error: str | None = None
        self.max_engine_restarts = max_engine_restarts
        self.restarts = 0
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._restarting = False
        self._restart_waiters: list[asyncio.Future] = []
        self._closing = False
        self._generation = 0
        self._liveness: list[EngineLiveness] = []
        self.client = self._start_client(self._generation)
        atexit.register(self.shutdown)

    def _start_client(self, generation: int) -> EngineCoreClient:
        """Start the engine cores (blocks until they are ready). Their messages carry
        `generation`, so those of engines replaced by a restart are ignored."""
        now = time.monotonic()
        self._liveness = [
            EngineLiveness(now, steps_moved_at=now) for _ in range(self.data_parallel_size)
        ]
        return EngineCoreClient(
            self.config,
            self.data_parallel_size,
            lambda message: self._from_reader(message, generation),
            lambda index, reason: self._death_from_reader(index, reason, generation),
        )

    # Accessors ----------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """As `LLM.get_default_sampling_params`: the model's generation config over
        `SamplingParams()`'s defaults; a fresh object each call."""
        return SamplingParams(**self._generation_defaults)

    def is_healthy(self) -> bool:
        """True while every engine core is alive and progressing (see the module docstring)."""
        return not self.health_problem()

    def health_problem(self) -> str:
        """Why the engine is not healthy, or "" when it is."""
        if self.dead_error is not None:
            return f"the engine died: {self.dead_error}"
        if self._restarting:
            return "the engine core is restarting"
        now = time.monotonic()
        for index, liveness in enumerate(self._liveness):
            problem = liveness.problem(now, self.heartbeat_timeout_s, self.stall_timeout_s)
            if problem:
                return f"engine core {index}: {problem}"
        return ""

    def engine_stats(self) -> list[dict[str, Any]]:
        """The latest `engine_stats` of each engine that reported."""
        return [s for s in self._engine_stats if s is not None]

    def num_unfinished(self) -> int:
        """Sequences sent to the engines and not finished (n per request)."""
        return sum(self._in_flight)

    async def wait_dead(self) -> str:
        """Return the reason once the engine dies (at once when it is dead)."""
        if self.dead_error is not None:
            return self.dead_error
        waiter = self._bind_loop().create_future()
        self._dead_waiters.append(waiter)
        return await waiter

    # Requests -----------------------------------------------------------------------------
    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
        return loop

    def _pick_engine(self) -> int:
        def load(index: int) -> int:
            stats = self._engine_stats[index] or {}
            return self._in_flight[index] + 3 * int(stats.get("num_waiting_reqs", 0))

        return min(range(self.data_parallel_size), key=load)

    def _check_capacity(self, num_sequences: int) -> None:
        if self.max_num_waiting is None:
            return
        capacity = self.data_parallel_size * self.config.scheduler.max_num_seqs
        waiting = self.num_unfinished() + num_sequences - capacity
        if waiting > self.max_num_waiting:
            raise QueueFullError(
                f"the queue is full: {self.num_unfinished()} sequences in flight, "
                f"{capacity} run at once and max_num_waiting is {self.max_num_waiting}; "
                "retry later",
                retry_after_s=1,
            )

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; see the module docstring for the contracts."""
        loop = self._bind_loop()
        if self._restarting:  # wait for the new engine cores
            waiter = loop.create_future()
            self._restart_waiters.append(waiter)
            await waiter
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if not isinstance(request_id, str):
            raise TypeError(f"request_id: expected a string, got {type(request_id).__name__}")
        params = sampling_params or self.get_default_sampling_params()
        text, token_ids = self._builder.prompt_token_ids(prompt, "prompt")
        child_ids = [f"{request_id}-{next(self._serials)}" for _ in range(params.n)]
        requests = [
            self._builder.build(
                cid, token_ids, params.child(j) if params.n > 1 else params, priority
            )
            for j, cid in enumerate(child_ids)
        ]
        for r in requests:
            check_request(r, self.config, self._has_grammar)
        self._check_capacity(len(requests))
        parent = _Parent(
            request_id,
            child_ids,
            self._pick_engine(),
            RequestStream(self.stream_buffer_size),
            params.output_kind,
        )
        self._parents.setdefault(request_id, []).append(parent)
        for j, r in enumerate(requests):
            self._child_parent[r.request_id] = (parent, j)
            self.output_processor.add_request(
                r.request_id, text, r.prompt_token_ids, r.arrival_time, r.sampling_params
            )
            self._timings.add(
                r.request_id, r.arrival_time, r.num_prompt_tokens, r.sampling_params.max_tokens
            )
            self._in_flight[parent.engine_index] += 1
            self.client.send(parent.engine_index, AddRequest.of(r))
        done = False
        try:
            while True:
                output = await parent.stream.get()
                done = output.finished
                yield output
                if done:
                    return
        finally:
            if not done:
                self._abort_parent(parent, "abort")
            self._forget_parent(parent)

    async def abort(self, request_id: str) -> None:
        """Abort every request in flight under the label `request_id` (each generator then
        ends without a final output); unknown labels are ignored."""
        for parent in list(self._parents.get(request_id, ())):
            self._abort_parent(parent, "abort")
            parent.stream.fail(asyncio.CancelledError(f"request {request_id} was aborted"))

    def _abort_parent(self, parent: _Parent, reason: str) -> None:
        live = [cid for cid in parent.child_ids if cid in self._child_parent]
        if not live:
            return
        if self.dead_error is None and not self._restarting:
            self.client.send(parent.engine_index, AbortRequests(live))
        stats = IterationStats(engine_index=parent.engine_index)
        for cid in live:
            self._end_child(cid, reason, stats)
        self._record(parent.engine_index, None, stats)

    def _end_child(self, child_id: str, reason: str, stats: IterationStats) -> None:
        entry = self._child_parent.pop(child_id, None)
        if entry is None:
            return
        self._in_flight[entry[0].engine_index] -= 1
        self.output_processor.records.pop(child_id, None)
        self._timings.end(child_id, reason, stats)

    def _forget_parent(self, parent: _Parent) -> None:
        same_label = self._parents.get(parent.request_id, [])
        if parent in same_label:
            same_label.remove(parent)
            if not same_label:
                del self._parents[parent.request_id]
        parent.stream.closed = True

    # Engine messages (on the event loop) --------------------------------------------------
    def _from_reader(self, message: Any, generation: int) -> None:
        if generation != self._generation:
            return
        index = getattr(message, "engine_index", 0)
        if index < len(self._liveness):
            self._liveness[index].hear(message, time.monotonic())
        if isinstance(message, EngineCoreHeartbeat):
            return
        loop = self._loop
        if isinstance(message, EngineCoreOutputs) and not message.outputs:
            self._engine_stats[message.engine_index] = message.stats  # an idle engine's stats
            if loop is None:
                return
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._handle_message, message)

    def _death_from_reader(self, engine_index: int, reason: str, generation: int) -> None:
        if generation != self._generation:
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            self.dead_error = self.dead_error or reason
            return
        loop.call_soon_threadsafe(self._die, reason, generation)

    def _handle_message(self, message: Any) -> None:
        if isinstance(message, EngineCoreOutputs):
            self._handle_outputs(message)
        elif isinstance(message, EngineCoreDead):
            reason = f"engine core {message.engine_index} died: {message.error}"
            self._die(reason, self._generation)

    def _handle_outputs(self, message: EngineCoreOutputs) -> None:
        index = message.engine_index
        if message.stats is not None:
            self._engine_stats[index] = message.stats
        outputs = message.outputs
        stats = self._timings.observe(outputs, index)
        for output in self.output_processor.stream(outputs):
            entry = self._child_parent.get(output.request_id)
            if entry is not None:
                self._deliver(entry[0], entry[1], output)
        stopped = self.output_processor.ended_here
        if stopped:
            self.output_processor.ended_here = {}
            by_engine: dict[int, list[str]] = {}
            for rid, reason in stopped.items():
                entry = self._child_parent.get(rid)
                if entry is not None:
                    by_engine.setdefault(entry[0].engine_index, []).append(rid)
                self._timings.end(rid, reason, stats)
            for engine_index, ids in by_engine.items():
                self.client.send(engine_index, AbortRequests(ids))
        for out in outputs:
            if out.finish_reason is not None and out.request_id in self._child_parent:
                self._release(out.request_id)
        for rid in stopped:
            self._release(rid)
        self._record(index, message.stats, stats)

    def _release(self, child_id: str) -> None:
        entry = self._child_parent.pop(child_id, None)
        if entry is not None:
            self._in_flight[entry[0].engine_index] -= 1

    def _deliver(self, parent: _Parent, index: int, output: RequestOutput) -> None:
        completion = output.outputs[0]
        completion.index = index
        if completion.finished:
            parent.finished.add(index)
        finished = len(parent.finished) == len(parent.child_ids)
        if len(parent.child_ids) == 1:
            output.request_id = parent.request_id  # the internal id never leaves
            merged = output
        elif parent.output_kind == RequestOutputKind.DELTA:
            merged = self._as_parent(parent, output, [completion], finished)
        else:
            parent.latest[index] = completion
            if parent.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                return
            merged = self._as_parent(parent, output, sorted_outputs(parent.latest), finished)
        if not parent.stream.put(merged):  # the consumer is too far behind: abort
            self._abort_parent(parent, "abort")

    @staticmethod
    def _as_parent(
        parent: _Parent, output: RequestOutput, outputs: list[CompletionOutput], finished: bool
    ) -> RequestOutput:
        return RequestOutput(
            request_id=parent.request_id,
            prompt=output.prompt,
            prompt_token_ids=output.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=output.metrics,
            num_cached_tokens=output.num_cached_tokens,
            error=output.error,
            prompt_logprobs=output.prompt_logprobs,
        )

    def _record(
        self, engine_index: int, engine_stats: dict[str, Any] | None, stats: IterationStats
    ) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(engine_index, engine_stats, stats)
            except Exception:  # metrics must never take the engine down
                logger.exception("stat logger %r failed", stat_logger)

    def _die(self, reason: str, generation: int) -> None:
        if self.dead_error is not None or self._restarting or generation != self._generation:
            return
        self._fail_in_flight(EngineDeadError(reason))
        if self.restarts < self.max_engine_restarts and not self._closing:
            self._restart(reason)
            return
        self.dead_error = reason
        logger.error("the engine died: %s", reason)
        for waiter in self._dead_waiters:
            if not waiter.done():
                waiter.set_result(reason)
        self._dead_waiters.clear()

    def _fail_in_flight(self, error: EngineDeadError) -> None:
        """End every sequence in flight (counted as errors) and raise `error` into every
        stream, after the outputs it already holds."""
        stats = IterationStats()
        for child_id in list(self._child_parent):
            self._end_child(child_id, "error", stats)
        self._record(0, None, stats)
        for parents in list(self._parents.values()):
            for parent in parents:
                parent.stream.fail(error)

    def _restart(self, reason: str) -> None:
        """Start new engine cores on a thread (the loop goes on); requests wait for them."""
        self._restarting = True
        self.restarts += 1
        logger.error(
            "the engine core died (%s); restarting it (%d of at most %d restarts)",
            reason,
            self.restarts,
            self.max_engine_restarts,
        )
        loop, old, generation = self._bind_loop(), self.client, self._generation + 1

        def start() -> None:
            old.shutdown(timeout_s=5.0)
            try:
                client = self._start_client(generation)
            except Exception as exc:  # the restart itself failed: the death is final
                message = f"{reason}; the restart failed: {exc}"
                loop.call_soon_threadsafe(self._restart_done, None, generation, message)
                return
            loop.call_soon_threadsafe(self._restart_done, client, generation, reason)

        threading.Thread(target=start, name="tandem-engine-restart", daemon=True).start()

    def _restart_done(self, client: EngineCoreClient | None, generation: int, reason: str) -> None:
        self._restarting = False
        if client is None or self._closing:
            if client is not None:
                client.shutdown()
            self.dead_error = None
            self.max_engine_restarts = self.restarts  # no further attempt
            self._die(reason, self._generation)
        else:
            self.client, self._generation = client, generation
            self._in_flight = [0] * self.data_parallel_size
            self._engine_stats = [None] * self.data_parallel_size
            self._record(0, {"engine_core_restarts": self.restarts}, IterationStats())
            logger.warning("the engine core is running again (restart %d)", self.restarts)
        for waiter in self._restart_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._restart_waiters.clear()

    def shutdown(self) -> None:
        """Stop the engine-core processes. Idempotent."""
        self._closing = True
        self.client.shutdown()


def sorted_outputs(latest: dict[int, CompletionOutput]) -> list[CompletionOutput]:
    return [latest[j] for j in sorted(latest)]
