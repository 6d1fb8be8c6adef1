"""The e2e helpers' deadlines: the machine's slowness factor, the CPU time of a process
tree, and the rule that lets a server past its health deadline keep starting only while
its processes use CPU."""

from __future__ import annotations

import subprocess
import sys

from e2e_helpers import (
    PROGRESS_CPU_S,
    PROGRESS_LIMIT,
    PROGRESS_WINDOW_S,
    ServerProcess,
    machine_slowness,
    scaled,
    tree_cpu_seconds,
    wait_for,
)


def test_slowness_is_measured_once_and_never_below_one() -> None:
    factor = machine_slowness()
    assert factor >= 1.0
    assert machine_slowness() == factor  # the session's one measurement
    assert scaled(10.0) == 10.0 * factor


def test_a_server_past_its_deadline_waits_only_while_it_uses_cpu() -> None:
    deadline = 100.0
    idle = [(t, 5.0) for t in range(0, 131)]
    busy = [(t, 5.0 + t * PROGRESS_CPU_S / 10) for t in range(0, 131)]
    assert not ServerProcess._progressing(idle, 130.0, deadline)
    assert ServerProcess._progressing(busy, 130.0, deadline)
    # Only the last PROGRESS_WINDOW_S count: CPU used long ago is no progress now.
    stalled = [(t, min(t, 60) * 1.0) for t in range(0, 131)]
    assert 130 - PROGRESS_WINDOW_S > 60
    assert not ServerProcess._progressing(stalled, 130.0, deadline)
    # Never past PROGRESS_LIMIT deadlines, busy or not.
    end = PROGRESS_LIMIT * deadline
    assert not ServerProcess._progressing(busy + [(end, 1e6)], end, deadline)


def test_tree_cpu_seconds_counts_the_children() -> None:
    spin = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass"
    parent = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', sys.argv[1]])"
    proc = subprocess.Popen([sys.executable, "-c", parent, spin])
    try:
        used = wait_for(
            lambda: (lambda cpu: cpu if cpu >= 0.5 else None)(tree_cpu_seconds(proc.pid)),
            scaled(60),
            "the child's CPU time counted in the tree",
        )
        assert used >= 0.5
    finally:
        proc.kill()
        proc.wait(10)
    assert tree_cpu_seconds(proc.pid) == 0.0  # gone: nothing to count
