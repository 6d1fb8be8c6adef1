"""The worker pins glibc's mmap threshold so large per-step buffers return to the OS."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tandem.core.worker.host_heap import glibc_function

pytestmark = pytest.mark.skipif(
    glibc_function("mallopt") is None or not os.path.exists("/proc/self/status"),
    reason="glibc and /proc only",
)

#: After a warm-up (the kernels' first use maps their code), allocates a 16 MB tensor twice
#: (touching every page), freeing it each time, then prints the resident growth in MB. Unpinned, the first free raises glibc's threshold to 16 MB, the
#: second buffer comes from the heap and stays resident after its free.
PROBE = textwrap.dedent(
    """
    import sys
    import torch
    from tandem.core.worker.host_heap import pin_mmap_threshold

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    torch.set_num_threads(1)
    pinned = pin_mmap_threshold() if sys.argv[1] == "pin" else False
    torch.ones(1 << 19).sum()  # first use of the fill and sum kernels: their code pages
    before = rss_mb()
    for _ in range(2):
        buffer = torch.ones(4 << 20)  # 16 MB, every page written
        del buffer
    print(pinned, rss_mb() - before)
    """
)


def _probe(mode: str, **env: str) -> tuple[bool, float]:
    environment = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        timeout=300,
        env={**environment, **env},
        check=True,
    )
    pinned, growth = done.stdout.split()
    return pinned == "True", float(growth)


def test_pinned_threshold_returns_a_freed_large_buffer() -> None:
    """Pinned, two 16 MB buffers in turn leave under 4 MB resident; unpinned (glibc's
    dynamic threshold) the second stays resident after its free."""
    pinned, growth = _probe("pin")
    assert pinned
    assert growth < 4
    unpinned, unpinned_growth = _probe("none")
    assert not unpinned
    assert unpinned_growth > 12


def test_the_users_environment_setting_stands() -> None:
    """With `MALLOC_MMAP_THRESHOLD_` set glibc's own reading of it is left alone."""
    pinned, _ = _probe("pin", MALLOC_MMAP_THRESHOLD_="65536")
    assert not pinned


def test_a_worker_pins_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a worker (the scripted model, in this process) pins the threshold."""
    from tandem.core.worker import worker as worker_module
    from tandem.testing.engine import scripted_config

    calls: list[int] = []
    monkeypatch.setattr(worker_module, "pin_mmap_threshold", lambda: calls.append(1) or True)
    worker_module.Worker(scripted_config())
    assert calls == [1]
