"""All-reduce through shared memory for tensor-parallel ranks on one host (CPU tensors).

gloo's TCP ring costs about a millisecond per call on a small host, and a decode step makes
two per layer. Ranks on one host share a file in `/dev/shm` instead (the `mp` executor
creates it, `parallel_state.initialize` maps it):

    header: one int64 sequence number per rank
    data:   2 buffers x world_size slots of `slot_bytes` each (double-buffered by call parity)

A call with sequence s writes this rank's tensor into its slot of buffer s % 2, publishes s,
waits until every rank has published s, then sums the slots in rank order into the tensor:
every rank adds the same numbers in the same order, so every rank gets the same bits. A rank
can only write buffer s % 2 again at call s + 2, after every rank has published s + 1, which
each does only after finishing its reads of call s: no slot is overwritten while read.
(x86-64 keeps stores in order and loads in order, so a published sequence number implies
its data is visible.) Tensors larger than a slot fall back to gloo.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch

#: Bytes per rank and buffer: 8 MiB = 2M float32 values (2048 tokens x hidden 1024).
DEFAULT_SLOT_BYTES = 8 << 20
_HEADER_BYTES = 4096
#: How long a rank waits for its peers in one all-reduce before it gives up.
WAIT_LIMIT_S = 300.0


def shm_size(world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> int:
    return _HEADER_BYTES + 2 * world_size * slot_bytes


def create_shm_file(world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> Path:
    """A zero-filled file in /dev/shm (or the temp dir) for `world_size` ranks; the caller
    removes it when the ranks are gone."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    path = base / f"tandem-allreduce-{os.getpid()}-{time.monotonic_ns()}"
    with open(path, "wb") as f:
        f.truncate(shm_size(world_size, slot_bytes))
    return path


class ShmAllReduce:
    """One rank's view of the shared file (see the module docstring)."""

    def __init__(
        self, path: str | Path, rank: int, world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES
    ) -> None:
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), shm_size(world_size, slot_bytes))
        self._seqs = np.frombuffer(self._map, dtype=np.int64, count=world_size)
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=_HEADER_BYTES)
        self._seq = 0

    def _slot(self, buffer: int, rank: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        start = (buffer * self.world_size + rank) * self.slot_bytes
        return self._data[start : start + nbytes].view(dtype)

    def all_reduce(self, tensor: torch.Tensor) -> bool:
        """Sum `tensor` (contiguous, on the CPU) over the ranks in place; False (nothing
        done) when it does not fit a slot."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.slot_bytes or not tensor.is_contiguous() or tensor.device.type != "cpu":
            return False
        flat = tensor.view(-1)
        buffer = self._publish(flat, nbytes)
        flat.copy_(self._slot(buffer, 0, nbytes, tensor.dtype))
        for r in range(1, self.world_size):
            flat.add_(self._slot(buffer, r, nbytes, tensor.dtype))
        return True

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `tensor` (equal shapes) concatenated along the last dimension in
        rank order; None when it does not fit a slot."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.slot_bytes or tensor.device.type != "cpu":
            return None
        buffer = self._publish(tensor.contiguous().view(-1), nbytes)
        parts = [
            self._slot(buffer, r, nbytes, tensor.dtype).view(tensor.shape)
            for r in range(self.world_size)
        ]
        return torch.cat(parts, dim=-1)

    def _publish(self, flat: torch.Tensor, nbytes: int) -> int:
        """Write `flat` to this rank's slot of the next call's buffer, publish the call and
        wait for every rank's; the buffer index."""
        self._seq += 1
        seq, buffer = self._seq, self._seq % 2
        self._slot(buffer, self.rank, nbytes, flat.dtype).copy_(flat)
        self._seqs[self.rank] = seq
        spins, deadline = 0, None
        while int(self._seqs.min()) < seq:
            spins += 1
            if spins > 64:
                os.sched_yield()
            if spins % 4096 == 0:  # a peer that never arrives has died or failed its step
                deadline = deadline or time.monotonic() + WAIT_LIMIT_S
                if time.monotonic() > deadline:
                    late = [r for r in range(self.world_size) if self._seqs[r] < seq]
                    raise RuntimeError(f"all-reduce {seq}: ranks {late} did not arrive")
        return buffer
