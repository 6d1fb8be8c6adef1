"""Batch-1 latency with and without `parallel.yield_to_load`, beside busy neighbours.

    python benchmarks/yield_to_load.py [--neighbours 2] [--rounds 2] [--requests 5]

Starts `--neighbours` processes that each spin a pure-Python loop (each stops by itself after
`--max-neighbour-s`, and all are killed at the end), waits 3 s, then alternates
`on, off, on, off, ...` (`--rounds` pairs): each variant is a fresh `AsyncLLM` on the
embedded SmolLM2 (float32, async scheduling, `worker_num_threads` = the usable cores, the
given `yield_to_load`), one warm-up request, 3 s for the governor's window, then
`--requests` requests of a 128-token prompt and 16 greedy tokens, one at a time: TTFT and
TPOT each. With `--neighbours 0` it measures what the governor costs on a quiet machine.
Writes benchmarks/results/yield_to_load.json (every run, per-variant medians, the load
average, the CPU model and flags).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from busy_neighbours import spin  # noqa: E402
from serve_compare import cpu_flags  # noqa: E402


async def measure(yield_to_load: bool, requests: int) -> dict[str, Any]:
    from tandem import SamplingParams
    from tandem.engine.async_llm import AsyncLLM

    cores = len(os.sched_getaffinity(0))
    engine = AsyncLLM(
        max_model_len=512,
        async_scheduling=True,
        worker_num_threads=cores,
        yield_to_load=yield_to_load,
    )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    async def one(n: int) -> tuple[float, float]:
        prompt = [rng.randint(100, 40_000) for _ in range(n)]
        start, stamps = time.perf_counter(), []
        async for _ in engine.generate({"prompt_token_ids": prompt}, params, f"r{rng.random()}"):
            stamps.append(time.perf_counter())
        return (stamps[0] - start) * 1000, (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000

    try:
        await one(64)
        await asyncio.sleep(3.0)  # the governor's window (5 samples, 0.5 s apart)
        runs = [await one(128) for _ in range(requests)]
    finally:
        engine.shutdown()
    return {
        "yield_to_load": yield_to_load,
        "ttft_ms": [round(t, 1) for t, _ in runs],
        "tpot_ms": [round(p, 2) for _, p in runs],
        "ttft_ms_p50": statistics.median(t for t, _ in runs),
        "tpot_ms_p50": statistics.median(p for _, p in runs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--neighbours", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--max-neighbour-s", type=float, default=900.0)
    p.add_argument("--out", default=str(ROOT / "results" / "yield_to_load.json"))
    args = p.parse_args()
    neighbours = [
        multiprocessing.Process(target=spin, args=(args.max_neighbour_s,), daemon=True)
        for _ in range(args.neighbours)
    ]
    for n in neighbours:
        n.start()
    load_before = list(os.getloadavg())
    runs: list[dict[str, Any]] = []
    try:
        time.sleep(3.0)
        for _ in range(args.rounds):
            for variant in (True, False):
                runs.append(asyncio.run(measure(variant, args.requests)))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        for n in neighbours:
            n.kill()
    medians = {
        name: {
            key: statistics.median(r[key] for r in runs if r["yield_to_load"] == flag)
            for key in ("ttft_ms_p50", "tpot_ms_p50")
        }
        for name, flag in (("on", True), ("off", False))
    }
    doc = {
        "what": "SmolLM2 batch 1 through AsyncLLM (async scheduling, float32, every usable "
        "core), yield_to_load on vs off, beside busy neighbours",
        "command": "python benchmarks/yield_to_load.py " + " ".join(sys.argv[1:]),
        "neighbours": args.neighbours,
        "cpu": cpu_flags(),
        "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()),
        "medians": medians,
        "tpot_off_over_on": medians["off"]["tpot_ms_p50"] / medians["on"]["tpot_ms_p50"],
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: doc[k] for k in ("medians", "tpot_off_over_on")}, indent=1))


if __name__ == "__main__":
    main()
