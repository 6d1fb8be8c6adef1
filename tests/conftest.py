"""Suite-wide settings: offline, one torch thread (two threads on a busy 2-core machine run
up to 40x slower)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The engine's worker takes OMP_NUM_THREADS as its default thread count (the Makefile
# exports 1): keep a bare `pytest` run at one thread too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_report_header() -> str:
    """The load average and CPU count at the start: a run's durations (and any bounded
    wait that ran out) read differently on a busy machine."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"load average: {load} on {os.cpu_count()} CPUs"
