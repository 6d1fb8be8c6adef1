"""The decode kernel's query tiles on one request's prefill chunk, against the same rows
run one decode item each, side by side in one process.

    python benchmarks/query_tiles.py [--threads 1] [--lengths 128,250,500] [--repeats 15]

SmolLM2's attention shape (9 query / 3 KV heads of 64, block 16), one request's chunk of
L rows over a fresh context (row i sees i + 1 keys), bf16 and float32 pools. The kernel
tiles consecutive rows that see one key more each with the same block table
(`csrc/paged_decode.cpp`, `query_tiles`); the same rows in reverse order (lengths
falling) form no tile, so that call is the untiled kernel on the same work, with no
switch in the code. Both outputs are compared (the tiles keep each row bit-identical).
Medians over `--repeats` calls, alternated; writes benchmarks/results/query_tiles.json
with the CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tandem.models.cpu_features import cpu_flags, cpu_model_name
from tandem.models.cpu_kernels import paged_decode_kernel

ROOT = Path(__file__).resolve().parent.parent
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lengths", default="128,250,500")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/query_tiles.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernel = paged_decode_kernel()
    if kernel is None:
        raise SystemExit("query_tiles: the compiled decode kernel is unavailable")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for length in (int(n) for n in args.lengths.split(",")):
            blocks = -(-length // BLOCK)
            k_pool = torch.randn(blocks + 4, KV_HEADS, HEAD_DIM, BLOCK, generator=gen).to(dtype)
            v_pool = torch.randn(blocks + 4, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            table = torch.randperm(blocks + 4, generator=gen)[:blocks]
            tables = table.repeat(length, 1).contiguous()
            lens = torch.arange(1, length + 1)
            q = torch.randn(length, Q_HEADS, HEAD_DIM, generator=gen)
            back = torch.arange(length - 1, -1, -1)
            calls = {
                "tiles": (q, lens),
                "rows": (q[back].contiguous(), lens[back].contiguous()),
            }
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.repeats + 1):  # the first round warms up
                for name, (queries, seq_lens) in calls.items():
                    start = time.perf_counter()
                    kernel(queries, k_pool, v_pool, tables, seq_lens, HEAD_DIM**-0.5)
                    times[name].append(time.perf_counter() - start)
            tiled = kernel(q, k_pool, v_pool, tables, lens, HEAD_DIM**-0.5)
            reversed_q, reversed_lens = calls["rows"]
            untiled = kernel(reversed_q, k_pool, v_pool, tables, reversed_lens, HEAD_DIM**-0.5)
            row = {
                "pool_dtype": str(dtype).removeprefix("torch."),
                "rows": length,
                "tiles_ms": 1e3 * statistics.median(times["tiles"][1:]),
                "rows_ms": 1e3 * statistics.median(times["rows"][1:]),
                "max_abs_difference": float((tiled - untiled[back]).abs().max()),
            }
            row["speedup"] = row["rows_ms"] / row["tiles_ms"]
            rows.append(row)
            print(
                f"{row['pool_dtype']:9s} {length:5d} rows: tiles {row['tiles_ms']:.3f} ms, "
                f"one item per row {row['rows_ms']:.3f} ms, {row['speedup']:.2f}x, "
                f"max |difference| {row['max_abs_difference']:.1e}"
            )
    document = {
        "cpu": cpu_model_name(),
        "cpu_flags": sorted(cpu_flags()),
        "threads": args.threads,
        "repeats": args.repeats,
        "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
        "results": rows,
    }
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
