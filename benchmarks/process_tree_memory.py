"""Peak memory of a process and all its descendants, sampled from /proc (Linux).

vLLM V1 runs its engine core (and on CPU its worker) in child processes, so the runner's
own `ru_maxrss` misses most of its memory. `TreeMemorySampler` watches a spawned run from
outside: every `interval_s` it finds the process's descendants and records
- `peak_rss_tree_mib`: the largest sum of VmRSS over the tree at one sample (pages shared
  between the processes, e.g. the same libraries, count once per process);
- `peak_pss_tree_mib`: the same with Pss (shared pages split between their sharers: the
  fairest single figure for a multi-process engine);
- `sum_vmhwm_mib`: the sum of every process's own peak (VmHWM, kept by the kernel, so no
  peak between samples is missed; an upper bound of the tree's peak).
Compiler processes (a kernel built at first use) are left out by name.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

EXCLUDED_NAMES = frozenset({"cc1plus", "cc1", "gcc", "g++", "c++", "as", "ld", "collect2", "ninja"})


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def process_tree(pid: int) -> list[int]:
    """`pid` and every live descendant."""
    children = _children_map()
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def _read_kib(pid: int) -> tuple[str, dict[str, int]] | None:
    """(name, {VmRSS, VmHWM, Pss} in KiB) of one process, or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields: dict[str, int] = {}
    name = ""
    for line in (status + rollup).splitlines():
        key, _, rest = line.partition(":")
        if key == "Name":
            name = rest.strip()
        elif key in ("VmRSS", "VmHWM", "Pss") and rest.strip().endswith("kB"):
            fields[key] = int(rest.split()[0])
    return name, fields


class TreeMemorySampler:
    """Samples the memory of `pid`'s process tree on a daemon thread until `stop()`."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_rss_kib = 0
        self.peak_pss_kib = 0
        self.hwm_kib: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> TreeMemorySampler:
        self._thread.start()
        return self

    def sample(self) -> None:
        """One sample of the tree (also called by the thread)."""
        rss = pss = 0
        for p in process_tree(self.pid):
            read = _read_kib(p)
            if read is None or read[0] in EXCLUDED_NAMES:
                continue
            name, kib = read
            rss += kib.get("VmRSS", 0)
            pss += kib.get("Pss", 0)
            previous = self.hwm_kib.get(p, (name, 0))[1]
            self.hwm_kib[p] = (name, max(previous, kib.get("VmHWM", 0)))
        self.peak_rss_kib = max(self.peak_rss_kib, rss)
        self.peak_pss_kib = max(self.peak_pss_kib, pss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> dict[str, Any]:
        """Stops sampling; the peaks in MiB and each process's own peak."""
        self._stop.set()
        self._thread.join(timeout=5)
        return {
            "peak_rss_tree_mib": self.peak_rss_kib / 1024,
            "peak_pss_tree_mib": self.peak_pss_kib / 1024,
            "sum_vmhwm_mib": sum(h for _, h in self.hwm_kib.values()) / 1024,
            "processes": [
                {"pid": p, "name": n, "vmhwm_mib": h / 1024} for p, (n, h) in self.hwm_kib.items()
            ],
        }
