"""The worker pins glibc's mmap and trim thresholds: a step's buffers are reused from the
heap, and only buffers over the mmap threshold go back to the OS at free."""

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

#: After a warm-up (the kernels' first use maps their code): a 16 MB tensor (every page
#: written) allocated and freed twice, printing the resident growth it leaves (MB).
#: Unpinned, the first free raises glibc's threshold to 16 MB, so the second buffer comes
#: from the heap and stays resident after its free. (Whether a buffer under the threshold
#: is reused without faults is not asserted: the kernel's reclaim makes fault counts vary
#: between runs; benchmarks measure the speed.)
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
    before_large = rss_mb()
    for _ in range(2):
        large = torch.ones(4 << 20)  # 16 MB: over the pinned mmap threshold
        del large
    print(pinned, rss_mb() - before_large)
    """
)


def _probe(mode: str, **env: str) -> tuple[bool, float]:
    drop = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    environment = {k: v for k, v in os.environ.items() if k not in drop}
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
    """Pinned, two 16 MB buffers (over the 8 MiB threshold) in turn leave under 4 MB
    resident; unpinned (glibc's dynamic threshold) the second stays resident after its
    free."""
    pinned, large_growth = _probe("pin")
    assert pinned
    assert large_growth < 4
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
