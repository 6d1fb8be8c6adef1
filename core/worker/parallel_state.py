"""Which rank this worker is, and the collectives its model calls.

A worker process of a multi-rank executor calls `initialize` once, before its model is
built; everything else (the single-rank executors, tests, the front door) sees the default
`RankInfo()`: rank 0 of 1, and collectives that return their input. Ranks are numbered
tp-major within a pipeline stage: `rank = pp_rank * tp_size + tp_rank` (vLLM's order).

torch.distributed runs on gloo for CPU tensors and NCCL for CUDA ones; with
`pipeline_parallel_size == 1` the tensor-parallel group is the whole world, else one group
per stage. Pipeline transfers are point to point (`pipeline.py`).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tandem.core.worker.shm_all_reduce import ShmAllReduce


@dataclass(frozen=True)
class RankInfo:
    """One rank's place: global rank, the world, the tensor- and pipeline-parallel sizes."""

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    local_rank: int = 0
    #: Ranks on this rank's host (they share its memory).
    local_world_size: int = 1
    host: str = field(default_factory=socket.gethostname)

    def __post_init__(self) -> None:
        if self.world_size != self.tp_size * self.pp_size:
            raise ValueError(
                f"world_size {self.world_size} != tp_size {self.tp_size} x pp_size {self.pp_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside [0, {self.world_size})")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_driver(self) -> bool:
        """Tensor-parallel rank 0 of the last pipeline stage (the stage that samples): the
        rank whose sampled output the engine receives."""
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1

    @property
    def driver_rank(self) -> int:
        return (self.pp_size - 1) * self.tp_size

    def describe(self) -> str:
        pp = f", pp {self.pp_rank}/{self.pp_size}" if self.pp_size > 1 else ""
        return f"rank {self.rank} (tp {self.tp_rank}/{self.tp_size}{pp}, host {self.host})"


_current = RankInfo()


@dataclass
class CollectiveTime:
    """Wall time this process spent inside collectives, and how many it ran."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0


collective_time = CollectiveTime()
#: This stage's tensor-parallel group (None: the whole world, when there is one stage).
_tp_group: dist.ProcessGroup | None = None
#: Shared-memory all-reduce between this host's tensor-parallel ranks (CPU, one stage).
_shm: ShmAllReduce | None = None


def current() -> RankInfo:
    """This process's rank (the default single rank unless `initialize` ran)."""
    return _current


def initialize(
    info: RankInfo, init_method: str, device: torch.device, shm_path: str | None = None
) -> None:
    """Join the process group (`init_method`, e.g. `tcp://127.0.0.1:PORT`) as `info.rank`:
    gloo on CPU, NCCL on CUDA. Blocks until every rank has joined. `shm_path`: the
    shared-memory file for CPU all-reduces between the ranks of one host (one stage)."""
    global _current, _shm
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(
        backend, init_method=init_method, rank=info.rank, world_size=info.world_size
    )
    _current = info
    if shm_path is not None and device.type == "cpu" and info.tp_size > 1 and info.pp_size == 1:
        _shm = ShmAllReduce(shm_path, info.tp_rank, info.tp_size)
    if info.pp_size > 1 and info.tp_size > 1:  # one group per stage; every rank makes all
        global _tp_group
        for stage in range(info.pp_size):
            group = dist.new_group(list(range(stage * info.tp_size, (stage + 1) * info.tp_size)))
            if stage == info.pp_rank:
                _tp_group = group


def shutdown() -> None:
    global _current, _tp_group, _shm
    if dist.is_initialized():
        dist.destroy_process_group()
    _current, _tp_group, _shm = RankInfo(), None, None


@dataclass
class CollectiveTime:
    """Wall time this process spent inside collectives, and how many it ran."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0


collective_time = CollectiveTime()


def tp_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over the tensor-parallel group, in place; the same bits on every rank.
    A no-op on one rank."""
    if _current.tp_size > 1:
        start = time.perf_counter()
        if _shm is None or not _shm.all_reduce(tensor):
            dist.all_reduce(tensor, group=_tp_group)
        _count(start, tensor)
    return tensor


def tp_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` (equal shapes) concatenated along the last dimension, in rank
    order. The input itself on one rank."""
    if _current.tp_size == 1:
        return tensor
    start = time.perf_counter()
    gathered = _shm.all_gather(tensor) if _shm is not None else None
    if gathered is None:
        parts = [torch.empty_like(tensor) for _ in range(_current.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=_tp_group)
        gathered = torch.cat(parts, dim=-1)
    _count(start, tensor)
    return gathered


def _count(start: float, tensor: torch.Tensor) -> None:
    collective_time.seconds += time.perf_counter() - start
    collective_time.calls += 1
    collective_time.bytes += tensor.numel() * tensor.element_size()
