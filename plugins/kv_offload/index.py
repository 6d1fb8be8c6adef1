"""The scheduler side's view of the offload store: which block keys each tier holds, in LRU
order, and the transfer plan that keeps the worker's store equal to that view.

Tiers: `cpu` (the worker's host memory, `cpu_blocks` blocks) and `disk` (files under the
store directory, `disk_blocks` blocks; off without a directory). A saved block enters the
cpu tier; the cpu tier's least recently used block moves to disk when the cpu tier is over
its size (or is dropped without a disk tier); the disk tier drops its least recently used
file when over its size. A hit or a save of a present key makes it the most recent.

Plans are applied by the worker in the order they were built, loads first, then saves,
then the tier moves of that plan, so a plan's loads read the tiers as the previous plans
left them: exactly the view `tier_of` gave when the loads were planned.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: A stored block's file name: `<key>` + this suffix.
FILE_SUFFIX = ".kv"


@dataclass(slots=True)
class OffloadPlan:
    """One step's transfers. `loads`: (key, block id, tier) read into the pool before the
    forward; `saves`: (key, block id) copied from the pool to the cpu tier after it;
    `moves`: ("demote", key) cpu -> disk, ("write", key) a copy of a cpu block to disk,
    ("drop_cpu", key), ("drop_disk", key), in order, after the saves."""

    loads: list[tuple[str, int, str]] = field(default_factory=list)
    saves: list[tuple[str, int]] = field(default_factory=list)
    moves: list[tuple[str, str]] = field(default_factory=list)
    #: Requests waiting for remote KV whose loads are all in this plan: reported in
    #: `finished_recving` once the loads ran.
    recv: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, metadata: OffloadPlan | dict[str, Any] | None) -> OffloadPlan | None:
        """The plan itself, or rebuilt from its wire form (a worker in another process gets
        connector metadata as plain data: a mapping of the fields, tuples as lists)."""
        if metadata is None or isinstance(metadata, OffloadPlan):
            return metadata
        return cls(
            loads=[(str(k), int(b), str(t)) for k, b, t in metadata.get("loads", ())],
            saves=[(str(k), int(b)) for k, b in metadata.get("saves", ())],
            moves=[(str(m), str(k)) for m, k in metadata.get("moves", ())],
            recv=[str(r) for r in metadata.get("recv", ())],
        )


class OffloadIndex:
    """LRU key sets of the two tiers and the plan being built for the next step."""

    def __init__(
        self, cpu_blocks: int, disk_blocks: int, disk_dir: Path | None, shared: bool = False
    ) -> None:
        self.cpu_blocks, self.disk_blocks, self.disk_dir = cpu_blocks, disk_blocks, disk_dir
        #: The directory is shared with other engines: every saved block is written to it at
        #: once, and a key no tier holds is looked for there (another engine's block).
        self.shared = shared and disk_dir is not None
        self.cpu: OrderedDict[str, None] = OrderedDict()
        self.disk: OrderedDict[str, None] = OrderedDict()
        self.plan = OffloadPlan()
        if disk_dir is not None:
            self._scan(disk_dir)

    def _scan(self, disk_dir: Path) -> None:
        """Adopt the files a previous engine left, oldest first (their contents are checked
        when loaded: a bad file is a failed load, never wrong tokens)."""
        files = sorted(disk_dir.glob("*" + FILE_SUFFIX), key=lambda p: p.stat().st_mtime_ns)
        for path in files:
            self.disk[path.name[: -len(FILE_SUFFIX)]] = None
        self._trim_disk()

    def tier_of(self, key: str) -> str | None:
        if key in self.cpu:
            return "cpu"
        if key in self.disk:
            return "disk"
        if self.shared and (self.disk_dir / (key + FILE_SUFFIX)).exists():  # type: ignore[operator]
            self.disk[key] = None  # another engine's block: adopted, trimmed at the next save
            return "disk"
        return None

    def plan_load(self, key: str, block_id: int) -> None:
        """Load a present key into `block_id` this step; it becomes the most recent."""
        tier = self.tier_of(key)
        assert tier is not None, f"plan_load of a key no tier holds: {key}"
        self.plan.loads.append((key, block_id, tier))
        (self.cpu if tier == "cpu" else self.disk).move_to_end(key)

    def plan_save(self, key: str, block_id: int) -> None:
        """Save `block_id` as `key` after this step's forward, unless a tier holds the key
        already (then it only becomes the most recent)."""
        tier = self.tier_of(key)
        if tier is not None:
            (self.cpu if tier == "cpu" else self.disk).move_to_end(key)
            return
        self.plan.saves.append((key, block_id))
        self.cpu[key] = None
        if self.shared:  # written through, for the other engines
            self.disk[key] = None
            self.plan.moves.append(("write", key))
        while len(self.cpu) > self.cpu_blocks:
            old, _ = self.cpu.popitem(last=False)
            if old in self.disk:  # written through already
                self.plan.moves.append(("drop_cpu", old))
            elif self.disk_dir is not None and self.disk_blocks > 0:
                self.disk[old] = None
                self.plan.moves.append(("demote", old))
            else:
                self.plan.moves.append(("drop_cpu", old))
        self._trim_disk()

    def _trim_disk(self) -> None:
        while len(self.disk) > self.disk_blocks:
            old, _ = self.disk.popitem(last=False)
            self.plan.moves.append(("drop_disk", old))

    def forget(self, key: str) -> None:
        """A key whose load failed: no tier holds it any more (the worker removed it)."""
        self.cpu.pop(key, None)
        self.disk.pop(key, None)

    def discard(self, key: str) -> None:
        """A key whose stored block may be wrong: no tier holds it after the next plan (the
        worker drops the copy and the file)."""
        if self.cpu.pop(key, "absent") is None:
            self.plan.moves.append(("drop_cpu", key))
        if self.disk.pop(key, "absent") is None:
            self.plan.moves.append(("drop_disk", key))

    def take_plan(self) -> OffloadPlan:
        plan, self.plan = self.plan, OffloadPlan()
        return plan
