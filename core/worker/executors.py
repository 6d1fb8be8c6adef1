"""Executors that run the worker elsewhere: a background thread, or a separate OS process.

Both return futures at once and resolve them in call order, so the engine's batch queue
overlaps planning with execution. The process executor is the shape that scales out: the
worker process rebuilds its own plugin manager and model from the (picklable) resolved
config; only `SchedulerOutput`, bitmasks and `ModelRunnerOutput` cross the pipe.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import torch

from tandem.core.config import EngineConfig
from tandem.core.executor import Executor
from tandem.core.model_runner_output import ModelRunnerOutput, resolve_output
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.worker import Worker


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
    """The worker process raised; the message carries its traceback."""


def _worker_main(config: EngineConfig, conn: Connection) -> None:
    try:
        worker = Worker(config)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        if kind == "shutdown":
            return
        try:
            if kind == "execute":
                result: Any = worker.execute_model(payload)
            else:  # only host data crosses the pipe: wait for the copy here
                result = resolve_output(worker.sample_tokens(payload))
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


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
        status, detail = self._conn.recv()
        if status != "ok":
            self.process.join(timeout=5)
            raise WorkerProcessError(f"the worker process failed to start:\n{detail}")
        self._pending: deque[Future] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._reader = threading.Thread(
            target=self._read_loop, name="tandem-worker-reader", daemon=True
        )
        self._reader.start()

    def _send(self, kind: str, payload: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise WorkerProcessError("the worker process has shut down")
            self._pending.append(future)
            self._conn.send((kind, payload))
        return future

    def _read_loop(self) -> None:
        while True:
            try:
                status, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.popleft()
            if status == "ok":
                future.set_result(payload)
            else:
                future.set_exception(WorkerProcessError(f"the worker process raised:\n{payload}"))
        with self._lock:
            self._closed = True
            while self._pending:
                self._pending.popleft().set_exception(
                    WorkerProcessError("the worker process exited")
                )

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        return self._send("execute", scheduler_output)

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        return self._send("sample", grammar_bitmask)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(OSError):
                self._conn.send(("shutdown", None))
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
        self._conn.close()
