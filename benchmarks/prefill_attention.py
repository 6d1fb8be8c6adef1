"""Prefill attention on paged KV: where a chunk's time goes, and how close it is to the
machine's fp32 matmul roofline (issue 16 item 4).

SmolLM2-135M's shapes (9 query / 3 KV heads of 64, block 16, keys transposed per block as
with the CPU decode kernel), one request's prefill chunk of 128-2048 tokens over a cached
prefix of 0/512/1024 tokens, 1 and 2 threads. Per shape, medians (and bests) of
interleaved repeats (8 layers' pools cycled, so a gather does not always hit a warm cache):

- `gather_old`: the whole context (prefix + chunk) gathered from the pools;
- `sdpa_old`: SDPA on that gathered context (`is_causal`, or with a cached prefix an
  explicit causal-with-offset mask);
- `call_old`: the whole `paged_attention` call on the gathered path (KV write included);
- `gather_new`: only the prefix's blocks gathered (nothing without a prefix);
- `attn_new`: the chunk's fresh keys causal + the prefix unmasked, merged (flash op);
- `call_new`: the whole `paged_attention` call as it is now;
- `kv_write`: the KV write alone (in both calls).

Attention FLOPs count only the computed causal half: query i of a chunk of n after a
prefix of p sees p + i + 1 keys, QK^T and PV cost 2 D each per (query, key, head), so
FLOPs = 4 D Hq (n p + n (n + 1) / 2). The roofline is `machine_roofline.measure` in the
same run. Writes benchmarks/results/prefill_attention.json.

    python benchmarks/prefill_attention.py [--threads 1,2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine_roofline  # noqa: E402

import tandem.models.paged_attention as pa  # noqa: E402
from tandem.models.cpu_kernels import PagedDecodeKernel  # noqa: E402

Q_HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 8
CHUNKS, PREFIXES = (128, 512, 1024, 2048), (0, 512, 1024)
VARIANTS = (
    "gather_old",
    "sdpa_old",
    "call_old",
    "gather_new",
    "attn_new",
    "call_new",
    "kv_write",
)


class _Layer:
    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx


def attention_flops(chunk: int, prefix: int) -> float:
    """Causal-half FLOPs of one chunk (see the module docstring)."""
    return 4.0 * DIM * Q_HEADS * (chunk * prefix + chunk * (chunk + 1) / 2)


def _case(chunk: int, prefix: int) -> dict[str, Callable[[int], object]]:
    """Closures over one shape's pools and plan, each taking the layer to use."""
    context = prefix + chunk
    nb = -(-context // BLOCK)
    block_ids = torch.randperm(nb + 4)[:nb]
    pools = [
        (torch.randn(nb + 4, KV_HEADS, DIM, BLOCK), torch.randn(nb + 4, BLOCK, KV_HEADS, DIM))
        for _ in range(LAYERS)
    ]
    pos = torch.arange(prefix, context)
    slots = block_ids[pos // BLOCK] * BLOCK + pos % BLOCK
    kernel = cast(PagedDecodeKernel, object())  # marks the transposed layout; no decodes
    meta = pa.build_metadata(
        pools, slots, [0, chunk], [prefix], [context], block_ids[None], BLOCK, kernel
    )
    span = meta.prefills[0]
    qkv = torch.randn(chunk, (Q_HEADS + 2 * KV_HEADS) * DIM)  # the model's fused QKV rows
    q = qkv[:, : Q_HEADS * DIM].view(chunk, Q_HEADS, DIM)
    k = qkv[:, Q_HEADS * DIM : (Q_HEADS + KV_HEADS) * DIM].view(chunk, KV_HEADS, DIM)
    v = qkv[:, (Q_HEADS + KV_HEADS) * DIM :].view(chunk, KV_HEADS, DIM)
    query, key, value = (t.transpose(0, 1)[None] for t in (q, k, v))
    qp = query
    out = torch.empty_like(q)

    def gather(layer: int, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
        kp = pa._gather_transposed(pools[layer][0], blocks)[:, :, :length]
        return kp, pa._gather(pools[layer][1], blocks, 1)[:, :, :length]

    prefix_blocks = block_ids[: -(-prefix // BLOCK)]
    gathered = [gather(layer, block_ids, context) for layer in range(LAYERS)]
    prefixes = [gather(layer, prefix_blocks, prefix) for layer in range(LAYERS)]

    def old_attention(layer: int) -> torch.Tensor:
        kp, vp = gathered[layer]
        if prefix == 0:
            return torch.nn.functional.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, enable_gqa=True
            )
        mask = torch.arange(context)[None, :] <= pos[:, None]
        return torch.nn.functional.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=mask, enable_gqa=True
        )

    def new_attention(layer: int) -> None:
        with _patched_gathers(prefixes[layer]):
            pa._prefill_split(meta, layer, qp, key, value, span, None, out)

    def call(layer: int, flash: object) -> None:
        saved, pa._FLASH_CPU = pa._FLASH_CPU, flash
        try:
            pa.paged_attention(_Layer(layer), query, key, value, None, paged=meta)
        finally:
            pa._FLASH_CPU = saved

    flash = pa._FLASH_CPU
    return {
        "gather_old": lambda layer: gather(layer, block_ids, context),
        "sdpa_old": old_attention,
        "call_old": lambda layer: call(layer, None),
        "gather_new": lambda layer: gather(layer, prefix_blocks, prefix) if prefix else None,
        "attn_new": new_attention,
        "call_new": lambda layer: call(layer, flash),
        "kv_write": lambda layer: pa._write_kv(meta, layer, k, v),
    }


class _patched_gathers:
    """`_prefill_split` with its prefix gathers answered from precomputed tensors, so
    `attn_new` times the attention alone."""

    def __init__(self, kv: tuple[torch.Tensor, ...]) -> None:
        self.kv = kv

    def __enter__(self) -> None:
        self.saved = pa._gather_transposed, pa._gather
        pa._gather_transposed = lambda pool, blocks: self.kv[0]
        pa._gather = lambda pool, blocks, rows: self.kv[1]

    def __exit__(self, *exc: object) -> None:
        pa._gather_transposed, pa._gather = self.saved


def time_shape(chunk: int, prefix: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median and best ms per variant, repeats interleaved across variants (the best is
    the robust one when another process shares the 2 cores)."""
    fns = _case(chunk, prefix)
    inner = max(1, round(50e6 / attention_flops(chunk, prefix)))
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(repeats + 1):  # the first round warms
        for name in VARIANTS:
            start = time.perf_counter()
            for i in range(inner):
                fns[name]((r * inner + i) % LAYERS)
            if r:
                times[name].append((time.perf_counter() - start) / inner)
    return {
        "median": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "best": {name: min(t) * 1e3 for name, t in times.items()},
    }


def run_threads(threads: int, repeats: int) -> dict[str, Any]:
    roof = machine_roofline.measure(threads, repeats=3)
    torch.set_num_threads(threads)
    rows = []
    with torch.inference_mode():
        for chunk in CHUNKS:
            for prefix in PREFIXES:
                both = time_shape(chunk, prefix, repeats)
                ms = both["median"]
                flops = attention_flops(chunk, prefix)
                gflops = {
                    name: flops / ms[name] / 1e6
                    for name in ("sdpa_old", "call_old", "attn_new", "call_new")
                }
                rows.append(
                    {
                        "chunk": chunk,
                        "prefix": prefix,
                        "gflop": flops / 1e9,
                        "ms": ms,
                        "ms_best": both["best"],
                        "speedup_call_best": both["best"]["call_old"] / both["best"]["call_new"],
                        "gflops": gflops,
                        "pct_of_roofline": {
                            n: 100 * g / roof["roofline_gflops"] for n, g in gflops.items()
                        },
                        "gather_pct_of_call_old": 100 * ms["gather_old"] / ms["call_old"],
                        "speedup_call": ms["call_old"] / ms["call_new"],
                    }
                )
                print(_row_text(threads, rows[-1]), flush=True)
    run = {"threads": threads, "roofline": roof, "shapes": rows}
    run["summary"] = summarize(run)
    return run


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """One thread count's answer: the gather's share of the old call, the old call's and
    the new one's GFLOP/s as a % of the roofline, fresh (prefix 0) vs cached-prefix chunks."""
    shapes = run["shapes"]

    def span(rows: list[dict[str, Any]], get: Callable[[dict[str, Any]], float]) -> list[float]:
        values = [get(r) for r in rows]
        return [round(min(values), 2), round(max(values), 2)]

    fresh = [r for r in shapes if r["prefix"] == 0]
    cached = [r for r in shapes if r["prefix"] > 0]
    return {
        "gather_pct_of_call_old": span(shapes, lambda r: r["gather_pct_of_call_old"]),
        "fresh_call_new_pct_of_roofline": {
            r["chunk"]: round(r["pct_of_roofline"]["call_new"], 1) for r in fresh
        },
        "fresh_speedup_call": span(fresh, lambda r: r["speedup_call"]),
        "cached_speedup_call": span(cached, lambda r: r["speedup_call"]),
        "cached_call_old_pct_of_roofline": span(cached, lambda r: r["pct_of_roofline"]["call_old"]),
        "cached_call_new_pct_of_roofline": span(cached, lambda r: r["pct_of_roofline"]["call_new"]),
    }


def _row_text(threads: int, row: dict[str, Any]) -> str:
    ms, g = row["ms"], row["gflops"]
    return (
        f"t={threads} n={row['chunk']:5d} p={row['prefix']:5d} | gather {ms['gather_old']:6.2f} "
        f"sdpa {ms['sdpa_old']:7.2f} call {ms['call_old']:7.2f} ms ({g['call_old']:5.1f} GF/s) | "
        f"new: gather {ms['gather_new']:5.2f} attn {ms['attn_new']:7.2f} call {ms['call_new']:7.2f}"
        f" ms ({g['call_new']:5.1f} GF/s) x{row['speedup_call']:.2f}"
        f" (best x{row['speedup_call_best']:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/prefill_attention.json")
    args = parser.parse_args()
    if pa._FLASH_CPU is None:
        raise SystemExit("this torch has no CPU flash-attention op: only the old path exists")
    load_start = os.getloadavg()
    results = [run_threads(int(t), args.repeats) for t in args.threads.split(",")]
    report = {
        "what": "Prefill attention on paged KV, old (gathered context + SDPA) vs new "
        "(fresh chunk + gathered prefix, flash op, logsumexp merge), SmolLM2 shapes",
        "command": "python benchmarks/prefill_attention.py " + " ".join(sys.argv[1:]),
        "flops_formula": "4 * head_dim * q_heads * (chunk * prefix + chunk * (chunk + 1) / 2)",
        "machine": {
            **machine_roofline.cpu_flags(),
            "torch": torch.__version__,
            "load_average": {"start": load_start, "end": os.getloadavg()},
        },
        "runs": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
