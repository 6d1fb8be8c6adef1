"""The bf16 decoder path's element-wise ops and greedy pick, before and after stop 48's
changes, side by side in one process.

    python benchmarks/bf16_elementwise.py [--threads 2] [--rounds 5] [--repeats 20]

On SmolLM2-135M's shapes (hidden 576, 9/3 heads of 64, intermediate 1536, vocabulary
49,152) at 2,048 rows (a prefill step at the default token budget) and 32 rows (a decode
batch), one layer's ops:
- `silu_mul_bf16` and `add_rms_norm_bf16` from `models/csrc/fused_ops.cpp` built twice into
  a temporary directory: with `native_build.COMPILE_FLAGS` (which ask for 512-bit vectors)
  and with the same flags less `-mprefer-vector-width=512` (GCC's 256-bit default tuning);
- RoPE on a bf16 GEMM's qkv: `.float()` then the float32 kernel (before) against
  `rope_bf16`, the one-pass widen-and-rotate (after);
- the greedy pick over [rows, 49152] float32 logits: `argmax(dim=1)` (before) against
  `max(dim=1).indices` (after, `default_sampler.greedy_tokens`).
Variants take turns within each round; the median per round, then the median over rounds.
Writes benchmarks/results/bf16_elementwise.json with the CPU model and flags.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.core.worker.native_build import COMPILE_FLAGS, LINK_FLAGS
from tandem.models.cpu_features import cpu_flags, cpu_model_name
from tandem.models.fused_ops import FusedOps, _declare
from tandem.plugins.default_sampler import greedy_tokens

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "models" / "csrc" / "fused_ops.cpp"
WIDE = "-mprefer-vector-width=512"
HIDDEN, INTERMEDIATE, HEAD_DIM, Q_HEADS, KV_HEADS, VOCAB = 576, 1536, 64, 9, 3, 49_152


def build(flags: tuple[str, ...], directory: Path, name: str) -> FusedOps:
    """fused_ops.cpp compiled with `flags` and loaded."""
    obj, lib = directory / f"{name}.o", directory / f"{name}.so"
    subprocess.run(["g++", *flags, "-c", str(SOURCE), "-o", str(obj)], check=True)
    subprocess.run(["g++", *LINK_FLAGS, str(obj), "-o", str(lib)], check=True)
    library = ctypes.CDLL(str(lib))
    _declare(library)
    return FusedOps(library)


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def cases(ops: dict[str, FusedOps], rows: int) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * INTERMEDIATE, generator=gen)).bfloat16()
    h = torch.randn(rows, HIDDEN, generator=gen)
    delta = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    weight = torch.randn(HIDDEN, generator=gen)
    qkv = torch.randn(rows, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).bfloat16()
    positions = torch.randint(0, 512, (rows,), generator=gen)
    angles = torch.rand(512, HEAD_DIM, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    logits = torch.randn(min(rows, 64), VOCAB, generator=gen)
    out: dict[str, Callable[[], object]] = {}
    for tag, lib in ops.items():
        out[f"silu_mul_bf16/{tag}"] = lambda lib=lib: lib.silu_mul_bf16(gate_up)
        out[f"add_rms_norm_bf16/{tag}"] = lambda lib=lib: lib.add_rms_norm_bf16_(
            h, delta, weight, 1e-5
        )

    def rope_before() -> object:
        q = qkv.float()
        ops["512"].rope_(q, positions, cos, sin, Q_HEADS, KV_HEADS)
        return q

    out["rope/float_then_rope"] = rope_before
    out["rope/rope_bf16"] = lambda: ops["512"].rope_bf16(
        qkv, positions, cos, sin, Q_HEADS, KV_HEADS
    )
    out["greedy/argmax"] = lambda: logits.argmax(dim=1)
    out["greedy/max_indices"] = lambda: greedy_tokens(logits)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/bf16_elementwise.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    narrow_flags = tuple(f for f in COMPILE_FLAGS if f != WIDE)
    with tempfile.TemporaryDirectory() as tmp:
        ops = {
            "512": build(COMPILE_FLAGS, Path(tmp), "wide"),
            "256": build(narrow_flags, Path(tmp), "narrow"),
        }
        results: dict[str, dict[str, float]] = {}
        for rows in (2048, 32):
            runs = cases(ops, rows)
            per_round: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, fn in runs.items():
                    per_round[name].append(time_ms(fn, args.repeats))
            results[str(rows)] = {name: statistics.median(v) for name, v in per_round.items()}
    ratios = {
        rows: {
            "silu_mul_bf16 256/512": r["silu_mul_bf16/256"] / r["silu_mul_bf16/512"],
            "add_rms_norm_bf16 256/512": r["add_rms_norm_bf16/256"] / r["add_rms_norm_bf16/512"],
            "rope before/after": r["rope/float_then_rope"] / r["rope/rope_bf16"],
            "greedy before/after": r["greedy/argmax"] / r["greedy/max_indices"],
        }
        for rows, r in results.items()
    }
    doc = {
        "cpu": cpu_model_name(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))),
        "threads": args.threads,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "median_ms": results,
        "speedups": ratios,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    for rows, r in ratios.items():
        print(rows, "rows:", ", ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
