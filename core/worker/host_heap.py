"""The worker process's C heap: glibc's mmap and trim thresholds pinned, so a step's
buffers are reused from the heap and what stays resident is bounded and the same every run.

glibc serves an allocation of at least `M_MMAP_THRESHOLD` bytes (128 KiB at start) with its
own `mmap` and unmaps it at `free`; freed heap memory above `M_TRIM_THRESHOLD` at the heap's
top goes back to the OS. Both are dynamic: freeing a mapped block raises the mmap
threshold to the block's size (up to 32 MiB) and the trim threshold to twice that, so what
a run keeps resident depends on the order of its first large frees (a 64-sequence run of
the embedded model peaked 605-664 MB over identical repeats).

`pin_mmap_threshold` fixes them once (`mallopt`, which also turns the dynamic adjustment
off) at `MMAP_THRESHOLD_BYTES` (8 MiB) and a trim threshold `trim_threshold_for` the
model's dtype: `TRIM_THRESHOLD_BYTES` (32 MiB) for float32 activations,
`HALF_PRECISION_TRIM_THRESHOLD_BYTES` (64 MiB) for bfloat16 / float16 ones. A step's
buffers under 8 MiB (every activation of a decode batch, most of a prefill's) come from the
heap and are reused by the next op and step without faulting their pages in again; larger
ones are mapped fresh and returned at free, so they never fragment the heap; at most
32 MiB of freed heap top stays resident. Measured on the embedded model in bf16 (2 threads,
Sapphire Rapids; `python benchmarks/heap_thresholds.py`): 32 prompts prefilled at once
(2,048-token steps) took 1,742-1,764 ms with the mmap threshold at 4 MiB (every large
activation mapped and faulted in per op: 590-630 thousand page faults per burst, 28 % of
the CPU time in the kernel's fault path), 1,199-1,211 ms at 8 / 32 MiB and 1,115-1,183 ms
at 32 / 64 MiB. But at 32 / 64 MiB (or 16 / 32) the buffers of 8-32 MiB on the heap
fragment it: a 64-sequence run of the GGUF kept quantized (`benchmarks/quant_compare.py`)
peaked at 657-683 MB, over the 636 MB docs/quantization.md holds it to, against 620 MB at
8 / 32 MiB.
A bf16 2,048-token step's buffers are each under 8 MiB, so they all live on the heap, and
together (tens of MB freed at the step's end) they push the heap's free top past 32 MiB:
each step gave it back and faulted it in again. Pinned at 8 / 64 MiB the same burst took
849-926 ms (33-35 thousand faults) against 1,054-1,076 ms (134-165 thousand) at 8 / 32 MiB,
8 / 128 MiB 887-929 ms (`python benchmarks/heap_thresholds.py --settings
default,8/32,8/64,8/128`, `results/heap_thresholds_trim.json`). The quantized float32 run
above peaked at 645 MB with 64 MiB, over its 636 MB, so float32 keeps 32 MiB.
Process-wide, like the thread count: where the user set `MALLOC_MMAP_THRESHOLD_` (glibc's
environment tunable) nothing is pinned, and a user's `MALLOC_TRIM_THRESHOLD_` keeps the
trim threshold. Nothing happens where the C library is not glibc.
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
MMAP_THRESHOLD_BYTES = 8 << 20
#: The pinned trim threshold for float32 activations: freed memory at the heap's top
#: beyond this goes back.
TRIM_THRESHOLD_BYTES = 32 << 20
#: The pinned trim threshold for bfloat16 / float16 activations.
HALF_PRECISION_TRIM_THRESHOLD_BYTES = 64 << 20
#: glibc's `mallopt` parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
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


def trim_threshold_for(dtype: str) -> int:
    """The trim threshold for a model whose `model.dtype` is `dtype` (see the module
    docstring): `HALF_PRECISION_TRIM_THRESHOLD_BYTES` for "bfloat16" and "float16", else
    `TRIM_THRESHOLD_BYTES`."""
    if dtype in ("bfloat16", "float16"):
        return HALF_PRECISION_TRIM_THRESHOLD_BYTES
    return TRIM_THRESHOLD_BYTES


@functools.cache
def pin_mmap_threshold(trim_bytes: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at `MMAP_THRESHOLD_BYTES` and its trim threshold at
    `trim_bytes` (see the module docstring); once per process and value. False where the
    user's `MALLOC_MMAP_THRESHOLD_` stands or there is no glibc `mallopt`."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = glibc_function("mallopt")
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        return False
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        mallopt(M_TRIM_THRESHOLD, trim_bytes)
    logger.debug(
        "worker: glibc mmap / trim thresholds pinned at %d / %d bytes",
        MMAP_THRESHOLD_BYTES,
        trim_bytes,
    )
    return True
