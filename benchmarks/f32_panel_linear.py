"""fp32 `F32PanelLinear` (csrc/f32_gemm.cpp) against fp32 `PackedLinear` (oneDNN).

SmolLM2-135M's projection shapes (qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576, LM head 576->49152) at 1, 16, 64 and 256 rows, with 1 and 2 threads. Products of
at most 16 rows cycle through enough copies of the weight (>= 32 MB of float32) that they
stream their weights from memory as in a real decode step. The candidates take turns
(interleaved), at least 5 rounds each; GFLOP/s from the median (and the best) run.

    python benchmarks/f32_panel_linear.py [--threads 1 2] [--rows 1 16 64 256]

Writes benchmarks/results/f32_panel_linear.json with the CPU's flags and the load average
before and after (on a loaded machine the interleaved ratios mean more than the absolute
numbers).
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

from tandem.core.worker.cpu_features import cpu_flags
from tandem.core.worker.f32_panel_linear import F32PanelLinear, f32_gemm_kernel
from tandem.core.worker.packed_linear import PackedLinear

SHAPES = {  # name: (out_features, in_features)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
STREAM_BYTES = 32 << 20  # float32 weight bytes cycled per product of <= STREAM_ROWS rows
STREAM_ROWS = 16
MIN_ROUNDS = 5
MAX_ROUNDS = 9
TIME_CAP_S = 0.6


def interleaved_times(candidates: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    """Seconds per run of each candidate, taking turns: MIN_ROUNDS rounds, up to MAX_ROUNDS
    while under TIME_CAP_S in all."""
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {key: [] for key in candidates}
    spent, rounds = 0.0, 0
    while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and spent < TIME_CAP_S):
        rounds += 1
        for key, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
            spent += times[key][-1]
    return times


def measure_shape(name: str, threads: list[int], rows_list: list[int]) -> list[dict]:
    """Rows of results for one shape (layers built once, reused across row counts)."""
    out_f, in_f = SHAPES[name]
    copies = max(1, STREAM_BYTES // (out_f * in_f * 4))
    weights = [torch.randn(out_f, in_f) * 0.05 for _ in range(copies)]
    panel = [F32PanelLinear(w) for w in weights]
    onednn = [PackedLinear(w) for w in weights]
    del weights
    results = []
    for count in threads:
        torch.set_num_threads(count)
        for rows in rows_list:
            used = copies if rows <= STREAM_ROWS else 1
            x = torch.randn(rows, in_f)
            candidates: dict[str, Callable[[], object]] = {
                "panel": lambda x=x, n=used: [layer(x) for layer in panel[:n]],
                "onednn": lambda x=x, n=used: [layer(x) for layer in onednn[:n]],
            }
            flops = 2.0 * rows * out_f * in_f * used
            row: dict = {"threads": count, "rows": rows, "shape": name}
            for key, times in interleaved_times(candidates).items():
                row[key] = round(flops / statistics.median(times) / 1e9, 2)
                row[f"{key}_best"] = round(flops / min(times) / 1e9, 2)
            row["panel_vs_onednn"] = round(row["panel"] / row["onednn"], 3)
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--out", default="benchmarks/results/f32_panel_linear.json")
    args = parser.parse_args()
    kernel = f32_gemm_kernel()
    assert kernel is not None, "the fp32 panel GEMM kernel did not build"
    load_before = [round(v, 2) for v in os.getloadavg()]
    started = time.perf_counter()
    results = []
    for name in args.shapes:
        results += measure_shape(name, args.threads, args.rows)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx")))
    report = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "cpu_flags": flags,
        "kernel_vectorized": kernel.vectorized,
        "torch": torch.__version__,
        "load_average_before": load_before,
        "load_average_after": [round(v, 2) for v in os.getloadavg()],
        "wall_s": round(time.perf_counter() - started, 1),
        "unit": "GFLOP/s (2*rows*out*in per product); plain: median, _best: fastest run",
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
