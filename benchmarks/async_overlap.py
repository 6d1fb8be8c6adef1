"""Sync vs async scheduling on the real model with the worker-process executor, side by
side: the worker process at `--threads` torch threads, the engine process at 1. Runs
alternate (sync, async, sync, async, ...) so drift hits both; writes medians and the ratio
to benchmarks/results/async_overlap.json.

    python benchmarks/async_overlap.py [--workload benchmarks/workloads/small.json] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def run(workload: str, threads: int, async_scheduling: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "tandem.bench",
        "--run-peer",
        "tandem",
        "--workload",
        workload,
        "--threads",
        str(threads),
        "--set",
        'executor="process"',
        "--set",
        f"async_scheduling={'true' if async_scheduling else 'false'}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default=str(ROOT / "workloads" / "small.json"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for _ in range(args.repeats):
        runs["sync"].append(run(args.workload, args.threads, False))
        runs["async"].append(run(args.workload, args.threads, True))
    medians = {k: statistics.median(r["output_tokens_per_s"] for r in v) for k, v in runs.items()}
    result = {
        "workload": args.workload,
        "output_tokens_per_s_median": medians,
        "async_over_sync": medians["async"] / medians["sync"],
        "worker_threads": args.threads,
        "engine_threads": 1,
        "load_average": os.getloadavg(),
        "runs": runs,
    }
    (ROOT / "results" / "async_overlap.json").write_text(json.dumps(result, indent=2))
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("output_tokens_per_s_median", "async_over_sync", "load_average")
            }
        )
    )


if __name__ == "__main__":
    main()
