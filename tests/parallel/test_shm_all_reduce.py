"""The shared-memory all-reduce and all-gather: two processes, many calls in a row (the
double buffer reused), sums equal to the exact sum and the same bits on both ranks; a tensor
over the slot size is declined (the caller falls back to gloo)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import torch

from tandem.core.worker.shm_all_reduce import ShmAllReduce, create_shm_file

SLOT = 1 << 16
CALLS = 50


def _inputs(rank: int, call: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(7, 33, generator=g)


def _rank(path: str, rank: int, out: mp.Queue) -> None:
    shm = ShmAllReduce(path, rank, 2, SLOT)
    sums, gathers = [], []
    for call in range(CALLS):
        t = _inputs(rank, call)
        assert shm.all_reduce(t)
        sums.append(t)
        g = shm.all_gather(_inputs(rank, call)[:, :5])
        assert g is not None
        gathers.append(g)
    declined = shm.all_reduce(torch.zeros(SLOT // 4 + 1))
    # numpy, not torch tensors: torch shares tensors through the sender, which exits
    out.put((rank, torch.stack(sums).numpy(), torch.stack(gathers).numpy(), declined))


def test_two_processes_sum_and_gather_exactly_and_identically() -> None:
    path = create_shm_file(2, SLOT)
    try:
        ctx = mp.get_context("spawn")
        out: mp.Queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(str(path), r, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        got = [out.get(timeout=120) for _ in procs]
        results = {r: (torch.from_numpy(s), torch.from_numpy(g), d) for r, s, g, d in got}
        for p in procs:
            p.join(timeout=30)
    finally:
        Path(path).unlink(missing_ok=True)
    (s0, g0, d0), (s1, g1, d1) = results[0], results[1]
    assert torch.equal(s0, s1) and torch.equal(g0, g1)  # the same bits on both ranks
    expected = torch.stack([_inputs(0, c) + _inputs(1, c) for c in range(CALLS)])
    assert torch.equal(s0, expected)
    gathered = torch.stack(
        [torch.cat([_inputs(0, c)[:, :5], _inputs(1, c)[:, :5]], -1) for c in range(CALLS)]
    )
    assert torch.equal(g0, gathered)
    assert d0 is False and d1 is False
