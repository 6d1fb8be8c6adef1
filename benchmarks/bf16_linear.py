"""bf16-weight `Bf16Linear` against float32 `PackedLinear` (oneDNN) and bf16 `F.linear`.

SmolLM2-135M's projection shapes (qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576, LM head 576->49152) at 1, 64 and 2048 rows, with 1 and 2 threads. One-row timings
cycle through enough copies of the weight (>= 64 MB of float32) that the products stream
their weights from memory as in a real decode step; GFLOP/s are per product,
medians (and bests) over interleaved repeats, capped in time. The LM head is skipped at 2048
rows (prefill computes logits for the last rows only).

    python benchmarks/bf16_linear.py [--threads 1 2] [--rows 1 64 2048]

Writes benchmarks/results/bf16_linear.json with the CPU's flags and the load average (on
a loaded machine the ratios, measured interleaved, mean more than the absolute numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.core.worker.bf16_linear import Bf16Linear, bf16_gemm_kernel
from tandem.core.worker.cpu_features import cpu_flags
from tandem.core.worker.packed_linear import PackedLinear

SHAPES = {  # name: (out_features, in_features)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
STREAM_BYTES = 64 << 20  # float32 weight bytes cycled per one-row measurement
REPEATS = 7
TIME_CAP_S = 2.0


def interleaved_times(candidates: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    """Seconds per run of each candidate, the candidates taking turns (so load from other
    processes falls on all of them alike): up to REPEATS rounds, fewer once TIME_CAP_S is
    spent, at least 2."""
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {key: [] for key in candidates}
    spent, rounds = 0.0, 0
    while rounds < REPEATS and (spent < TIME_CAP_S or rounds < 2):
        rounds += 1
        for key, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
            spent += times[key][-1]
    return times


def measure(name: str, rows: int) -> dict[str, float]:
    """GFLOP/s of the three implementations on one shape and row count."""
    out_f, in_f = SHAPES[name]
    copies = max(1, STREAM_BYTES // (out_f * in_f * 4)) if rows == 1 else 1
    weights = [torch.randn(out_f, in_f) * 0.05 for _ in range(copies)]
    x = torch.randn(rows, in_f)
    x_bf16 = x.bfloat16()
    candidates: dict[str, Callable[[], object]] = {}
    bf16 = [Bf16Linear(w) for w in weights]
    candidates["bf16_kernel"] = lambda: [layer(x) for layer in bf16]
    fp32 = [PackedLinear(w) for w in weights]
    candidates["fp32_packed"] = lambda: [layer(x) for layer in fp32]
    plain_bf16 = [w.bfloat16() for w in weights]
    candidates["bf16_f_linear"] = lambda: [F.linear(x_bf16, w) for w in plain_bf16]
    flops = 2.0 * rows * out_f * in_f * copies
    result = {}
    for key, times in interleaved_times(candidates).items():
        result[key] = round(flops / statistics.median(times) / 1e9, 2)
        result[f"{key}_best"] = round(flops / min(times) / 1e9, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 2048])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--out", default="benchmarks/results/bf16_linear.json")
    args = parser.parse_args()
    kernel = bf16_gemm_kernel()
    assert kernel is not None, "the bf16 GEMM kernel did not build"
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            for name in args.shapes:
                if name == "lm_head" and rows > 64:
                    continue
                row = {"threads": threads, "rows": rows, "shape": name, **measure(name, rows)}
                row["bf16_vs_fp32"] = round(row["bf16_kernel"] / row["fp32_packed"], 3)
                print(json.dumps(row), flush=True)
                results.append(row)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx")))
    report = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": flags,
        "kernel_vectorized": kernel.vectorized,
        "torch": torch.__version__,
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "unit": "GFLOP/s (2*rows*out*in per product); plain: median, _best: fastest run",
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
