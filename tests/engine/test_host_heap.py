"""The worker pins glibc's mmap and trim thresholds: a step's buffers are reused from the
heap, and only buffers over the mmap threshold go back to the OS at free."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tandem.core.worker.host_heap import TRIM_THRESHOLD_BYTES, glibc_function, trim_threshold_for

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
    """Building a worker (the scripted model, in this process) pins the thresholds, the
    trim threshold by the model's dtype."""
    from tandem.core.worker import worker as worker_module
    from tandem.testing.engine import scripted_config

    calls: list[int] = []
    monkeypatch.setattr(worker_module, "pin_mmap_threshold", lambda trim: calls.append(trim))
    worker_module.Worker(scripted_config())
    assert calls == [TRIM_THRESHOLD_BYTES]


def test_half_precision_models_keep_a_larger_heap_top() -> None:
    assert trim_threshold_for("bfloat16") == trim_threshold_for("float16") == 64 << 20
    assert trim_threshold_for("float32") == trim_threshold_for("auto") == 32 << 20


#: Eight 6 MB blocks from glibc's malloc (each under the 8 MiB mmap threshold: heap
#: memory, nothing allocated between them), written, then freed top first: each free joins
#: the heap's free top, and what stays resident depends on the trim threshold.
TRIM_PROBE = textwrap.dedent(
    """
    import ctypes
    import sys
    from tandem.core.worker.host_heap import glibc_function, pin_mmap_threshold

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    assert pin_mmap_threshold(int(sys.argv[1]))
    malloc, free, memset = (glibc_function(n) for n in ("malloc", "free", "memset"))
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    before = rss_mb()
    blocks = [malloc(6 << 20) for _ in range(8)]
    for block in blocks:
        memset(block, 1, 6 << 20)
    for block in reversed(blocks):
        free(block)
    print(rss_mb() - before)
    """
)


@pytest.mark.parametrize("trim_mib,kept", [(32, False), (64, True)])
def test_the_trim_threshold_decides_whether_a_freed_heap_top_stays(
    trim_mib: int, kept: bool
) -> None:
    """48 MB freed at the heap's top: given back at a 32 MiB trim threshold (what stays is
    the last frees' 12 MB, under the threshold), kept whole at 64 MiB."""
    drop = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    environment = {k: v for k, v in os.environ.items() if k not in drop}
    done = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE, str(trim_mib << 20)],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        check=True,
    )
    growth = float(done.stdout.split()[-1])
    assert (growth > 40) == kept, growth
