"""The single-rank executors: the worker in the caller's thread, on a background thread, or
in a separate OS process; and `WorkerProcess`, the spawned worker the process executor and
the multi-rank `mp` executor (`multiproc_executor.py`) are built from.

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
import sys
import threading
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, ClassVar

import torch

from tandem.core.executor import Executor, completed
from tandem.core.messages import (
    CallWorker,
    ExecuteModel,
    FromWorker,
    RpcReply,
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
from tandem.core.worker import parallel_state
from tandem.core.worker.device import resolve_device
from tandem.core.worker.kv_memory import fit_kv_cache
from tandem.core.worker.parallel_state import RankInfo
from tandem.core.worker.process_start import process_context, start_process
from tandem.core.worker.worker import Worker
from tandem.schema.config import EngineConfig
from tandem.schema.sampling_params import SamplingParams


class InProcessExecutor(Executor):
    """The worker runs in the caller's thread; futures are already resolved when returned.

    Async semantics (steps queued, results consumed later) without overlap: the executor
    the correctness tests use.
    """

    runs_in_caller_process: ClassVar[bool] = True

    def __init__(self, config: EngineConfig, worker: Worker | None = None) -> None:
        self.worker = worker if worker is not None else Worker(config)
        fit_kv_cache(config, self)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        return completed(self.worker.execute_model, scheduler_output)

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        return completed(self.worker.sample_tokens, grammar_bitmask)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]


class ThreadExecutor(Executor):
    """The worker runs on one background thread (torch releases the GIL in its kernels)."""

    runs_in_caller_process: ClassVar[bool] = True

    def __init__(self, config: EngineConfig) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-worker")
        try:
            self.worker = self._pool.submit(Worker, config).result()
            fit_kv_cache(config, self)
        except BaseException:
            self._pool.shutdown(wait=True)
            raise

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        return self._pool.submit(self.worker.execute_model, scheduler_output)

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        return self._pool.submit(self.worker.sample_tokens, grammar_bitmask)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [self._pool.submit(getattr(self.worker, method), *args).result()]

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


def _worker_main(
    config: EngineConfig,
    conn: Connection,
    rank: RankInfo | None,
    init_method: str | None,
    shm_path: str | None = None,
) -> None:
    """A worker process: join the process group (a rank of a multi-rank executor), build the
    worker, then answer messages in order until `Shutdown` or the pipe closes. Only the
    driver rank sends its sampled output back; the others' replies are empty."""
    worker = None
    try:
        worker = start_worker(config, rank, init_method, shm_path)
    except BaseException:
        conn.send_bytes(encode(WorkerError(traceback.format_exc())))
        return
    conn.send_bytes(encode(WorkerReply()))
    driver = rank is None or rank.is_driver
    messages = decoder(ToWorker)
    try:
        while True:
            try:
                message = messages.decode(conn.recv_bytes())
            except EOFError:
                return
            if isinstance(message, Shutdown):
                return
            conn.send_bytes(answer(worker, message, driver))
    finally:
        parallel_state.shutdown()


def start_worker(
    config: EngineConfig,
    rank: RankInfo | None,
    init_method: str | None,
    shm_path: str | None = None,
) -> Worker:
    """Build this process's worker; as `rank` of a multi-rank executor, first join the
    process group at `init_method` (blocks until every rank has joined)."""
    if rank is not None:
        assert init_method is not None
        device = resolve_device(config.model.device)
        parallel_state.initialize(rank, init_method, device, shm_path)
        # Every rank draws the same unseeded samples: the same seed, the same calls.
        torch.manual_seed(config.model.seed)
    return Worker(config)


def answer(worker: Worker, message: ToWorker, driver: bool) -> bytes:
    """Run one message on `worker` and return the encoded reply: `WorkerReply` (the sampled
    output only on the `driver` rank), `RpcReply`, or `WorkerError` when it raised."""
    try:
        if isinstance(message, ExecuteModel):
            worker.execute_model(message.scheduler_output)
            return encode(WorkerReply())
        if isinstance(message, CallWorker):
            return encode(RpcReply(getattr(worker, message.method)(*message.args)))
        assert isinstance(message, SampleTokens)
        bitmask = message.grammar_bitmask  # only host data crosses: wait for the copy here
        output = resolve_output(worker.sample_tokens(bitmask.to_tensor() if bitmask else None))
        return encode(WorkerReply(output if driver else None))
    except BaseException:
        return encode(_worker_error(worker))


def settle(future: Future, name: str, reply: FromWorker) -> None:
    """Resolve `future` with a worker's decoded `reply`: its output, its RPC result, or a
    `WorkerProcessError` prefixed with `name` (naming the hook implementation that raised,
    when the worker found one)."""
    if isinstance(reply, WorkerReply):
        future.set_result(reply.output)
    elif isinstance(reply, RpcReply):
        future.set_result(reply.result)
    else:
        message = f"{name}: the worker process raised:\n{reply.traceback}"
        site = None
        if reply.plugin is not None:
            site = HookSite(reply.plugin, reply.hook or "?", None, False, reply.where or "?")
        future.set_exception(WorkerProcessError(message, site))


class WorkerProcess:
    """One spawned worker process and its pipe: messages go out in order, a reader thread
    resolves one future per message in the same order. `name` prefixes every error (a
    rank says which one it is)."""

    def __init__(
        self,
        config: EngineConfig,
        name: str,
        rank: RankInfo | None = None,
        init_method: str | None = None,
        shm_path: str | None = None,
    ) -> None:
        self.name = name
        self._conn, child = process_context().Pipe()
        self.process = start_process(
            _worker_main,
            (config, child, rank, init_method, shm_path),
            name=f"tandem-{name.replace(' ', '-')}",
            daemon=True,
        )
        child.close()
        self._replies = decoder(FromWorker)
        self._pending: deque[Future] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._reader: threading.Thread | None = None

    def wait_started(self, timeout_s: float | None = None) -> None:
        """Block until the worker is built (or raise `WorkerProcessError` with its
        traceback, or when it exits or `timeout_s` passes first); then start reading."""
        if not self._conn.poll(timeout_s):
            self.process.terminate()
            raise WorkerProcessError(f"{self.name}: the worker process did not start in time")
        try:
            started = self._replies.decode(self._conn.recv_bytes())
        except (EOFError, OSError):
            raise WorkerProcessError(
                f"{self.name}: the worker process exited while starting"
            ) from None
        if isinstance(started, WorkerError):
            self.process.join(timeout=5)
            raise WorkerProcessError(
                f"{self.name}: the worker process failed to start:\n{started.traceback}"
            )
        self._reader = threading.Thread(
            target=self._read_loop, name=f"tandem-{self.name.replace(' ', '-')}-reader", daemon=True
        )
        self._reader.start()

    def send(self, data: bytes) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise WorkerProcessError(f"{self.name}: the worker process has shut down")
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
            settle(future, self.name, reply)
        code = self.process.exitcode if not self.process.is_alive() else None
        with self._lock:
            self._closed = True
            while self._pending:
                self._pending.popleft().set_exception(
                    WorkerProcessError(
                        f"{self.name}: the worker process exited"
                        + (f" (exit code {code})" if code is not None else "")
                    )
                )

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                already = True
            else:
                already = False
                self._closed = True
                with contextlib.suppress(OSError):
                    self._conn.send_bytes(encode(Shutdown()))
        if not already or self.process.is_alive():
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout=5)
        self._conn.close()


def encode_step(scheduler_output: SchedulerOutput) -> bytes:
    """The step as bytes, once for every rank (a request whose data cannot be encoded is
    replaced by a stand-in that fails it alone: `_sendable`)."""
    try:
        return encode(ExecuteModel(scheduler_output))
    except (OverflowError, TypeError, ValueError) as exc:
        return encode(ExecuteModel(_sendable(scheduler_output, exc)))


class ProcessExecutor(Executor):
    """The worker runs in a spawned process; a reader thread resolves futures in order."""

    def __init__(self, config: EngineConfig) -> None:
        self._worker = WorkerProcess(config, "worker")
        self.process = self._worker.process
        try:
            self._worker.wait_started()
            fit_kv_cache(config, self)
        except BaseException:
            self._worker.shutdown()
            raise

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        return self._worker.send(encode_step(scheduler_output))

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        bitmask = TensorData.of(grammar_bitmask) if grammar_bitmask is not None else None
        return self._worker.send(encode(SampleTokens(bitmask)))

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [self._worker.send(encode(CallWorker(method, list(args)))).result()]

    def shutdown(self) -> None:
        self._worker.shutdown()


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
