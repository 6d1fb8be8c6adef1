"""What a KV connector's step plan moves, counted for the simulated device.

The virtual device (`virtual_device.py`) prices connector transfers (`StepShape.kv_*_blocks`)
and, with the token oracle, reports the loads the worker side would report. It reads the
plan a step carries (`SchedulerOutput.kv_connector_metadata`, opaque to the kernel) by the
documented shapes of the bundled connectors, duck-typed (the kernel imports no plugin), as
an object's attributes or a mapping's keys (the wire form):

- `kv-offload`: `loads` [(key, block id, tier)] read into the pool before the forward,
  `saves` [(key, block id)] copied out after it, `recv` [request ids] whose asynchronous
  loads all run in this plan (reported finished by this step). `moves` (tier moves, host
  memory to disk) do not cross the device's link and are not counted;
- `kv-disagg`: {"offload": <a kv-offload plan or None>, "remote": [[request id, [[key, block
  id], ...]], ...]}: remote loads, fetched by the consumer's loader thread;
- `kv-multi`: `children`, each read as above, summed.

Any other plan counts as no transfer (a third-party connector's transfers take no simulated
time unless its plan has these fields).

How the engine runs them, and so how the simulation times them: the worker waits for every
load of a step's plan before the forward and for every save after it (`kv_transfer.py`), so
local loads and saves lengthen the step that carries them (an asynchronous `kv-offload`
load too: it runs in the step that carries it, before the request is admitted). A remote
load runs on `kv-disagg`'s loader thread, one job after another, beside the steps: the
request is ready once its job ends (`RemoteLoads`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ConnectorTransfers:
    """One plan's transfers: blocks loaded and saved through this host's link, the
    requests whose asynchronous local loads the plan completes (`recv`), and the remote
    loads as (request id, blocks)."""

    load_blocks: int = 0
    save_blocks: int = 0
    recv: tuple[str, ...] = ()
    remote: tuple[tuple[str, int], ...] = ()

    def __add__(self, other: ConnectorTransfers) -> ConnectorTransfers:
        return ConnectorTransfers(
            self.load_blocks + other.load_blocks,
            self.save_blocks + other.save_blocks,
            self.recv + other.recv,
            self.remote + other.remote,
        )


NO_TRANSFERS = ConnectorTransfers()


def _field(plan: Any, name: str) -> Any:
    if isinstance(plan, Mapping):
        return plan.get(name)
    return getattr(plan, name, None)


def connector_transfers(metadata: Any) -> ConnectorTransfers:
    """The transfers of a step's connector plan (see the module docstring); no plan or an
    unknown one: none."""
    if metadata is None:
        return NO_TRANSFERS
    children = _field(metadata, "children")
    if isinstance(children, (list, tuple)):
        total = NO_TRANSFERS
        for child in children:
            total = total + connector_transfers(child)
        return total
    total = NO_TRANSFERS
    if isinstance(metadata, Mapping) and ("offload" in metadata or "remote" in metadata):
        total = connector_transfers(metadata.get("offload"))
        remote = tuple((str(rid), len(pairs)) for rid, pairs in metadata.get("remote") or ())
        return total + ConnectorTransfers(remote=remote)
    loads, saves, recv = (_field(metadata, n) for n in ("loads", "saves", "recv"))
    return total + ConnectorTransfers(
        load_blocks=len(loads or ()),
        save_blocks=len(saves or ()),
        recv=tuple(str(r) for r in recv or ()),
    )


class RemoteLoads:
    """The remote loads in flight on the simulated clock: one loader, jobs in the order
    their plans ran, each starting when both its step starts and the previous job ended.
    Invariant: `free_at` (when the loader is idle) never decreases."""

    def __init__(self, start: float = 0.0) -> None:
        self.free_at = start
        self._jobs: list[tuple[float, str]] = []  # (end, request id), ends increasing

    def start(self, request_id: str, at: float, seconds: float) -> float:
        """Queue a load of `seconds` handed over at `at`; returns when it ends."""
        if seconds < 0:
            raise ValueError(f"remote load seconds: expected >= 0, got {seconds}")
        end = max(at, self.free_at) + seconds
        self.free_at = end
        self._jobs.append((end, request_id))
        return end

    def finished_by(self, t: float) -> set[str]:
        """The requests whose loads ended at or before `t` (each reported once)."""
        done = {rid for end, rid in self._jobs if end <= t + 1e-12}
        self._jobs = [(end, rid) for end, rid in self._jobs if end > t + 1e-12]
        return done

    @property
    def next_end(self) -> float | None:
        """When the earliest load still running ends (None: none runs)."""
        return self._jobs[0][0] if self._jobs else None
