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


def _suite_default_dtype() -> None:
    """`TANDEM_TEST_DTYPE` replaces `model.dtype`'s default (`auto`) for the whole suite.
    Unset, it is float32 on a CUDA machine, where `auto` resolves to bfloat16 (as vLLM's
    does) while the parity tests compare against float32 references; `auto` keeps the
    product default."""
    wanted = os.environ.get("TANDEM_TEST_DTYPE", "float32" if torch.cuda.is_available() else "auto")
    if wanted == "auto":
        return
    from tandem.schema.config import EngineConfig, ModelConfig

    ModelConfig.model_fields["dtype"].default = wanted
    ModelConfig.model_rebuild(force=True)
    EngineConfig.model_rebuild(force=True)  # it holds a copy of ModelConfig's schema


_suite_default_dtype()


def pytest_report_header() -> str:
    """The load average and CPU count at the start: a run's durations (and any bounded
    wait that ran out) read differently on a busy machine."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"load average: {load} on {os.cpu_count()} CPUs"
