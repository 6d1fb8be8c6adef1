"""Throughput of one engine vs data parallelism on this host, through `AsyncLLM` (engine
cores in their own processes), beside the offline `LLM` with the same threads.

Configurations, each a fresh process, interleaved over `--repeats` rounds (medians):
offline LLM with k threads (k = 1 and all cores), AsyncLLM DP=1 with k threads (1 and all
cores), AsyncLLM DP=N with k=1 (N = cores). Greedy, EOS ignored, fp32. Writes
benchmarks/results/dp_scaling.json with output tokens/s per configuration and ratios.

    python benchmarks/dp_scaling.py [--workload default] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _requests(workload: str, limit: int | None) -> list[dict]:
    from tandem.bench import load_workload

    requests = load_workload(workload)["requests"]
    return requests[:limit] if limit else requests


def run_offline(threads: int, workload: str, limit: int | None) -> float:
    from tandem import LLM, SamplingParams

    requests = _requests(workload, limit)
    llm = LLM(model="default", worker_num_threads=threads, max_num_seqs=64, max_model_len=1024)
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests
    ]
    start = time.perf_counter()
    outs = llm.generate([r["prompt_token_ids"] for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def run_async(dp: int, threads: int, workload: str, limit: int | None) -> float:
    from tandem.engine import AsyncLLM
    from tandem.schema.sampling_params import RequestOutputKind, SamplingParams

    requests = _requests(workload, limit)
    engine = AsyncLLM(
        model="default",
        data_parallel_size=dp,
        worker_num_threads=threads,
        max_num_seqs=64 // dp,
        max_model_len=1024,
    )

    async def one(i: int, request: dict) -> int:
        params = SamplingParams(
            temperature=0,
            max_tokens=request["max_tokens"],
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        async for out in engine.generate(request["prompt_token_ids"], params, f"r{i}"):
            final = out
        return len(final.outputs[0].token_ids)

    async def main() -> tuple[int, float]:
        start = time.perf_counter()
        counts = await asyncio.gather(*[one(i, r) for i, r in enumerate(requests)])
        return sum(counts), time.perf_counter() - start

    tokens, elapsed = asyncio.run(main())
    engine.shutdown()
    return tokens / elapsed


def _child(kind: str, dp: int, threads: int, workload: str, limit: int | None) -> float:
    cmd = [sys.executable, __file__, "--child", kind, "--dp", str(dp), "--threads", str(threads)]
    cmd += ["--workload", workload] + (["--limit", str(limit)] if limit else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="default")
    parser.add_argument("--limit", type=int, help="first N requests only")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/dp_scaling.json"))
    parser.add_argument("--child", choices=["offline", "async"])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.child == "offline":
        print(run_offline(args.threads, args.workload, args.limit))
        return
    if args.child == "async":
        print(run_async(args.dp, args.threads, args.workload, args.limit))
        return
    cores = len(os.sched_getaffinity(0))
    configs = {
        "offline k=1": ("offline", 1, 1),
        f"offline k={cores}": ("offline", 1, cores),
        "async dp=1 k=1": ("async", 1, 1),
        f"async dp=1 k={cores}": ("async", 1, cores),
        f"async dp={cores} k=1": ("async", cores, 1),
    }
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, (kind, dp, threads) in configs.items():
            runs[name].append(_child(kind, dp, threads, args.workload, args.limit))
            print(f"{name}: {runs[name][-1]:.1f} tok/s", flush=True)
    medians = {name: statistics.median(v) for name, v in runs.items()}
    base = medians["async dp=1 k=1"]
    result = {
        "workload": args.workload,
        "limit": args.limit,
        "cores": cores,
        "cpu": platform.processor() or platform.machine(),
        "output_tokens_per_s": runs,
        "median_tokens_per_s": medians,
        "ratio_to_async_dp1_k1": {name: m / base for name, m in medians.items()},
        "serving_overhead_async_over_offline": {
            "k=1": medians["async dp=1 k=1"] / medians["offline k=1"],
            f"k={cores}": medians[f"async dp=1 k={cores}"] / medians[f"offline k={cores}"],
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median_tokens_per_s"], indent=2))


if __name__ == "__main__":
    main()
