"""The executors: the worker in the caller's thread, on a background thread, or in a
separate OS process.

The thread and process executors return futures at once and resolve them in call order, so
the engine's batch queue overlaps planning with execution. The process executor is the
shape that scales out: the worker process rebuilds its own plugin manager and model from
the resolved config (handed over once, at spawn); each step then crosses the pipe as typed
messages without pickle (`tandem.core.messages`): `ExecuteModel`, `SampleTokens` out,
`WorkerReply` or `WorkerError` back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import sys
import threading
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

import torch

from tandem.config import EngineConfig
from tandem.core.executor import Executor, completed
from tandem.core.messages import (
    ExecuteModel,
    FromWorker,
    SampleTokens,
    Shutdown,
    TensorData,
    ToWorker,
    WorkerError,
    WorkerReply,
    decoder,
    encode,
)
from tandem.core.model_runner_output import ModelRunnerOutput, resolve_output
from tandem.core.plugin_error import HookSite, failing_hook
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.worker import Worker
from tandem.sampling_params import SamplingParams


class InProcessExecutor(Executor):
    """The worker runs in the caller's thread; futures are already resolved when returned.

    Async semantics (steps queued, results consumed later) without overlap: the executor
    the correctness tests use.
    """

    def __init__(self, config: EngineConfig, worker: Worker | None = None) -> None:
        self.worker = worker if worker is not None else Worker(config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        return completed(self.worker.execute_model, scheduler_output)

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        return completed(self.worker.sample_tokens, grammar_bitmask)


class ThreadExecutor(Executor):
    """The worker runs on one background thread (torch releases the GIL in its kernels)."""

    def __init__(self, config: EngineConfig) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-worker")
        self.worker = self._pool.submit(Worker, config).result()

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        return self._pool.submit(self.worker.execute_model, scheduler_output)

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        return self._pool.submit(self.worker.sample_tokens, grammar_bitmask)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class WorkerProcessError(RuntimeError):
    """The worker process raised; the message carries its traceback. `hook_site`, when a
    hook implementation raised it there, names it (`PluginManager.plugin_error` reads it)."""

    def __init__(self, message: str, hook_site: HookSite | None = None) -> None:
        super().__init__(message)
        self.hook_site = hook_site


def _worker_error(worker: Worker) -> WorkerError:
    """The exception being handled as a `WorkerError`, naming the hook implementation that
    raised it when there is one (found here, where its frames are)."""
    exc = sys.exc_info()[1]
    site = failing_hook(exc, worker.plugin_manager.hook_sites()) if exc is not None else None
    if site is None:
        return WorkerError(traceback.format_exc())
    return WorkerError(traceback.format_exc(), site.plugin, site.hook, site.where)


def _worker_main(config: EngineConfig, conn: Connection) -> None:
    try:
        worker = Worker(config)
    except BaseException:
        conn.send_bytes(encode(WorkerError(traceback.format_exc())))
        return
    conn.send_bytes(encode(WorkerReply()))
    messages = decoder(ToWorker)
    while True:
        try:
            message = messages.decode(conn.recv_bytes())
        except EOFError:
            return
        if isinstance(message, Shutdown):
            return
        try:
            if isinstance(message, ExecuteModel):
                worker.execute_model(message.scheduler_output)
                reply = encode(WorkerReply())
            else:  # only host data crosses the pipe: wait for the copy here
                bitmask = message.grammar_bitmask
                output = worker.sample_tokens(bitmask.to_tensor() if bitmask else None)
                reply = encode(WorkerReply(resolve_output(output)))
        except BaseException:
            reply = encode(_worker_error(worker))
        conn.send_bytes(reply)


class ProcessExecutor(Executor):
    """The worker runs in a spawned process; a reader thread resolves futures in order."""

    def __init__(self, config: EngineConfig) -> None:
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_worker_main, args=(config, child), name="tandem-worker", daemon=True
        )
        self.process.start()
        child.close()
        self._replies = decoder(FromWorker)
        started = self._replies.decode(self._conn.recv_bytes())
        if isinstance(started, WorkerError):
            self.process.join(timeout=5)
            raise WorkerProcessError(f"the worker process failed to start:\n{started.traceback}")
        self._pending: deque[Future] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._reader = threading.Thread(
            target=self._read_loop, name="tandem-worker-reader", daemon=True
        )
        self._reader.start()

    def _send(self, data: bytes) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise WorkerProcessError("the worker process has shut down")
            self._pending.append(future)
            self._conn.send_bytes(data)
        return future

    def _read_loop(self) -> None:
        while True:
            try:
                reply = self._replies.decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.popleft()
            if isinstance(reply, WorkerReply):
                future.set_result(reply.output)
            else:
                message = f"the worker process raised:\n{reply.traceback}"
                site = None
                if reply.plugin is not None:
                    hook, where = reply.hook or "?", reply.where or "?"
                    site = HookSite(reply.plugin, hook, None, False, where)
                future.set_exception(WorkerProcessError(message, site))
        with self._lock:
            self._closed = True
            while self._pending:
                self._pending.popleft().set_exception(
                    WorkerProcessError("the worker process exited")
                )

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        try:
            data = encode(ExecuteModel(scheduler_output))
        except (OverflowError, TypeError, ValueError) as exc:
            data = encode(ExecuteModel(_sendable(scheduler_output, exc)))
        return self._send(data)

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        bitmask = TensorData.of(grammar_bitmask) if grammar_bitmask is not None else None
        return self._send(encode(SampleTokens(bitmask)))

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(OSError):
                self._conn.send_bytes(encode(Shutdown()))
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
        self._conn.close()


def _sendable(scheduler_output: SchedulerOutput, error: Exception) -> SchedulerOutput:
    """`scheduler_output` with each new request that cannot be encoded on its own (a value
    the wire format cannot carry, e.g. an integer past 64 bits) replaced by a stand-in that
    carries only the reason (`NewRequestData.input_error`): the worker ends that request
    alone. Raises `error` again when no single request explains it."""
    replaced = []
    for new in scheduler_output.scheduled_new_reqs:
        try:
            encode(ExecuteModel(dataclasses.replace(scheduler_output, scheduled_new_reqs=[new])))
            replaced.append(new)
        except (OverflowError, TypeError, ValueError) as exc:
            reason = f"its data cannot be sent to the worker process: {exc}"
            replaced.append(
                dataclasses.replace(new, sampling_params=SamplingParams(), input_error=reason)
            )
    if all(a is b for a, b in zip(replaced, scheduler_output.scheduled_new_reqs, strict=True)):
        raise error
    return dataclasses.replace(scheduler_output, scheduled_new_reqs=replaced)
