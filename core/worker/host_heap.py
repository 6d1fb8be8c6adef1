"""The worker process's C heap: glibc's mmap threshold pinned so per-step buffers go back.

glibc serves an allocation of at least `M_MMAP_THRESHOLD` bytes (128 KiB at start) with its
own `mmap` and unmaps it at `free`. The threshold is dynamic: freeing such a block raises it
to the block's size (up to 32 MiB), and the trim threshold with it to twice that, so after a
step's first large free (a 64-row step's 12 MB of logits, a prefill's activations) later
buffers of that size come from the heap and up to twice the largest of them stays resident
after they are freed. A 64-sequence run of the embedded model then peaked 605-664 MB over
repeats instead of 605-607 MB.

`pin_mmap_threshold` sets the threshold once (`mallopt(M_MMAP_THRESHOLD)`, which also turns
the dynamic adjustment off) at `MMAP_THRESHOLD_BYTES`: a decode step's buffers (a batch-1
step's largest, its logits row, is under 200 KB) stay on the heap and are reused as before;
buffers of 4 MB and more are mapped fresh and returned at free, a page-fault cost that is
small against the step that needs them (measured: no change in tokens per second at 64
sequences). Process-wide, like the thread count: where the user set
`MALLOC_MMAP_THRESHOLD_` (glibc's environment tunable) that choice stands. Nothing happens
where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Any

logger = logging.getLogger("tandem.worker")

#: The pinned threshold: allocations of this many bytes or more are mapped and unmapped.
MMAP_THRESHOLD_BYTES = 4 << 20
#: glibc's `mallopt` parameter number for the mmap threshold (malloc.h).
M_MMAP_THRESHOLD = -3


@functools.cache
def glibc_function(name: str) -> Any | None:
    """The C library's function `name` (a ctypes function), or None where the library or
    the function is missing. Looked up once per name: `ctypes.util.find_library` runs
    `ldconfig -p` in a subprocess on every call."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        return getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None


@functools.cache
def pin_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at `MMAP_THRESHOLD_BYTES` (see the module docstring),
    once per process. False where the user's `MALLOC_MMAP_THRESHOLD_` stands or there is no
    glibc `mallopt`."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = glibc_function("mallopt")
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        return False
    logger.debug("worker: glibc mmap threshold pinned at %d bytes", MMAP_THRESHOLD_BYTES)
    return True
