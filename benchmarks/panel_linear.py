"""The panel GEMM (`models/panel_linear.py`) against oneDNN, per weight format.

- `--weights float32`: `F32PanelLinear` vs fp32 `PackedLinear` (oneDNN prepacked), the
  choice `linear_choice.cpu_f32_linear` makes. Default rows 1, 16, 64, 256.
- `--weights bfloat16`: `Bf16Linear` (bf16 weights, float32 compute) vs fp32 `PackedLinear`
  and bf16 `F.linear` (what torch does with bf16 weights on a CPU without bf16 units).
  Default rows 1, 64, 2048.

SmolLM2-135M's projection shapes (qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576, LM head 576->49152; the LM head only up to 256 rows: prefill computes logits for
the last rows only), with 1 and 2 threads. Products of at most 16 rows cycle through enough
copies of the weight (>= 32 MB of float32) that they stream their weights from memory as
in a real decode step. The candidates take turns (interleaved), at least 5 rounds each;
GFLOP/s from the median (and the best) run.

    python benchmarks/panel_linear.py --weights float32|bfloat16 [--threads 1 2] [--rows ...]

Writes benchmarks/results/f32_panel_linear.json (float32) or bf16_linear.json (bfloat16)
with the CPU's flags and the load average before and after (on a loaded machine the
interleaved ratios mean more than the absolute numbers).
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

from tandem.models.cpu_features import cpu_flags
from tandem.models.packed_linear import PackedLinear
from tandem.models.panel_linear import Bf16Linear, F32PanelLinear, panel_gemm_kernel

SHAPES = {  # name: (out_features, in_features)
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
STREAM_BYTES = 32 << 20  # float32 weight bytes cycled per product of <= STREAM_ROWS rows
STREAM_ROWS = 16
LM_HEAD_MAX_ROWS = 256
MIN_ROUNDS = 5
MAX_ROUNDS = 9
TIME_CAP_S = 0.6
#: --weights -> (default rows, default output, the ratio reported: (name, numerator, denominator))
MODES = {
    "float32": ([1, 16, 64, 256], "f32_panel_linear.json", ("panel_vs_onednn", "panel", "onednn")),
    "bfloat16": ([1, 64, 2048], "bf16_linear.json", ("bf16_vs_fp32", "bf16_kernel", "fp32_packed")),
}

Layer = Callable[[torch.Tensor], torch.Tensor]


def build(weights: str, matrices: list[torch.Tensor]) -> dict[str, list[Layer]]:
    """The candidates' layers, one per weight copy."""
    candidates: dict[str, list[Layer]] = {}
    if weights == "float32":
        candidates["panel"] = [F32PanelLinear(w) for w in matrices]
    else:
        candidates["bf16_kernel"] = [Bf16Linear(w) for w in matrices]
        plain = [w.bfloat16() for w in matrices]
        candidates["bf16_f_linear"] = [
            lambda x, w=w: F.linear(x.bfloat16(), w)
            for w in plain  # type: ignore[misc]
        ]
    candidates["fp32_packed" if weights == "bfloat16" else "onednn"] = [
        PackedLinear(w) for w in matrices
    ]
    return candidates


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


def measure_shape(weights: str, name: str, threads: list[int], rows_list: list[int]) -> list[dict]:
    """Rows of results for one shape (layers built once, reused across row counts)."""
    out_f, in_f = SHAPES[name]
    copies = max(1, STREAM_BYTES // (out_f * in_f * 4))
    layers = build(weights, [torch.randn(out_f, in_f) * 0.05 for _ in range(copies)])
    ratio_name, numerator, denominator = MODES[weights][2]
    results = []
    for count in threads:
        torch.set_num_threads(count)
        for rows in rows_list:
            if name == "lm_head" and rows > LM_HEAD_MAX_ROWS:
                continue
            used = copies if rows <= STREAM_ROWS else 1
            x = torch.randn(rows, in_f)
            candidates: dict[str, Callable[[], object]] = {
                key: (lambda x=x, group=group[:used]: [layer(x) for layer in group])
                for key, group in layers.items()
            }
            flops = 2.0 * rows * out_f * in_f * used
            row: dict = {"threads": count, "rows": rows, "shape": name}
            for key, times in interleaved_times(candidates).items():
                row[key] = round(flops / statistics.median(times) / 1e9, 2)
                row[f"{key}_best"] = round(flops / min(times) / 1e9, 2)
            row[ratio_name] = round(row[numerator] / row[denominator], 3)
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", choices=list(MODES), default="float32")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--out")
    args = parser.parse_args()
    default_rows, default_out, _ = MODES[args.weights]
    kernel = panel_gemm_kernel()
    assert kernel is not None, "the panel GEMM kernel did not build"
    load_before = [round(v, 2) for v in os.getloadavg()]
    started = time.perf_counter()
    results = []
    for name in args.shapes:
        results += measure_shape(args.weights, name, args.threads, args.rows or default_rows)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "fma", "f16c", "amx")))
    report = {
        "command": f"python benchmarks/panel_linear.py --weights {args.weights}",
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
    out = Path(args.out or Path(__file__).resolve().parent / "results" / default_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
