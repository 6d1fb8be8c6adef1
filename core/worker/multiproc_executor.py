"""The `mp` executor: one worker process per rank on this host, in one process group."""

from __future__ import annotations

import socket
import threading
from abc import abstractmethod
from concurrent.futures import Future
from typing import Any, ClassVar

import torch

from tandem.core.executor import Executor
from tandem.core.messages import CallWorker, SampleTokens, TensorData, encode
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.executors import WorkerProcess, encode_step
from tandem.core.worker.kv_memory import fit_kv_cache
from tandem.core.worker.parallel_state import RankInfo
from tandem.core.worker.shm_all_reduce import create_shm_file
from tandem.schema.config import EngineConfig, ParallelConfig


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankedExecutor(Executor):
    """What every multi-rank executor shares: each step encoded once, the same bytes to
    every rank (`_send_all`, one future per rank, in rank order), and one future per call
    that holds the driver rank's result once every rank has answered, or the first rank's
    error at once (a rank stuck in a collective with a dead peer never answers; `shutdown`
    then ends it)."""

    max_world_size: ClassVar[int | None] = None
    #: The rank whose sampled output the engine receives (the last stage's tp rank 0).
    _driver: int = 0

    @abstractmethod
    def _send_all(self, data: bytes) -> list[Future]: ...

    def _broadcast(self, data: bytes) -> Future:
        futures = self._send_all(data)
        combined: Future = Future()
        lock = threading.Lock()

        def done(future: Future) -> None:
            with lock:
                if combined.done():
                    return
                if future.exception() is not None:
                    combined.set_exception(future.exception())
                elif all(f.done() for f in futures):
                    combined.set_result(futures[self._driver].result())

        for future in futures:
            future.add_done_callback(done)
        return combined

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        return self._broadcast(encode_step(scheduler_output))

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        bitmask = TensorData.of(grammar_bitmask) if grammar_bitmask is not None else None
        return self._broadcast(encode(SampleTokens(bitmask)))

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [f.result() for f in self._send_all(encode(CallWorker(method, list(args))))]


def rank_infos(parallel: ParallelConfig) -> list[RankInfo]:
    """Every rank's place, in rank order (tp-major within a stage)."""
    return [
        RankInfo(
            rank=r,
            world_size=parallel.world_size,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            local_rank=r,
            local_world_size=parallel.world_size,
        )
        for r in range(parallel.world_size)
    ]


def uses_shm_all_reduce(parallel: ParallelConfig) -> bool:
    """Whether the ranks sum through the shared-memory all-reduce (several tensor-parallel
    ranks in one stage, on one host)."""
    return parallel.tensor_parallel_size > 1 and parallel.pipeline_parallel_size == 1


class MultiprocExecutor(RankedExecutor):
    """`parallel.world_size` worker processes on this host, one per rank, joined in one
    torch.distributed group (gloo on CPU, NCCL on CUDA; rendezvous on 127.0.0.1).

    Every rank runs the whole step (its shard of every layer, the same sampling). A rank
    that raises or dies fails the step with an error naming the rank and host; the engine
    then stops."""

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.ranks = rank_infos(parallel)
        self._driver = self.ranks[0].driver_rank
        #: The shared-memory all-reduce file (one stage of tensor-parallel ranks on CPU).
        self._shm = (
            create_shm_file(parallel.tensor_parallel_size)
            if uses_shm_all_reduce(parallel)
            else None
        )
        shm = str(self._shm) if self._shm is not None else None
        self._workers = [
            WorkerProcess(config, info.describe(), info, init_method, shm) for info in self.ranks
        ]
        try:
            for worker in self._workers:  # all spawned first: each blocks until all joined
                worker.wait_started()
            fit_kv_cache(config, self)
        except BaseException:
            self.shutdown()
            raise

    def _send_all(self, data: bytes) -> list[Future]:
        return [worker.send(data) for worker in self._workers]

    def shutdown(self) -> None:
        """Stop every rank. When one has died, the others may be blocked in a collective
        with it: they are terminated instead of waited for."""
        if any(w.process.exitcode not in (None, 0) for w in self._workers):
            for worker in self._workers:
                if worker.process.is_alive():
                    worker.process.terminate()
        for worker in self._workers:
            worker.shutdown()
        if self._shm is not None:
            self._shm.unlink(missing_ok=True)
