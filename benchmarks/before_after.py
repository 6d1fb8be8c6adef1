"""Two versions of tandem on one workload, as interleaved pairs: is the change free?

Each run is one `python -m tandem.bench --run-peer tandem` process (the same harness as
`tandem bench`); the "before" process imports tandem from `--before-pythonpath` (a
directory whose `tandem/` package is the old checkout, e.g. built with
`cp -rs OLD/tandem DIR/tandem && ln -s OLD/core DIR/tandem/core` and so on for every
subpackage), the "after" process imports the installed tandem. Runs alternate
before/after so machine noise hits both alike; the JSON holds every run, the medians and
after/before ratios of throughput, TTFT, TPOT and the engine's per-step hook time.

    python benchmarks/before_after.py --before-pythonpath /tmp/before_pkg \
        --workload benchmarks/workloads/default.json --pairs 3 --out benchmarks/results/before_after_default.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run_once(workload: str, model: str, threads: int, pythonpath: str | None) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "tandem.bench", "--run-peer", "tandem"]
    cmd += ["--workload", workload, "--model", model, "--threads", str(threads)]
    start = time.perf_counter()
    # Run from a directory outside any checkout, so the working directory cannot shadow
    # the version under test.
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - start
    hooks = result.pop("hook_times", {}) or {}
    result["engine_hook_ms_per_step"] = sum(v.get("ms_per_step", 0.0) for v in hooks.values())
    return result


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before-pythonpath", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    load_before = os.getloadavg()
    for pair in range(args.pairs):
        order = ("before", "after") if pair % 2 == 0 else ("after", "before")
        for version in order:
            path = args.before_pythonpath if version == "before" else None
            result = run_once(args.workload, args.model, args.threads, path)
            runs[version].append(result)
            print(version, {k: result.get(k) for k in ("output_tokens_per_s", "error")})
    keys = ("output_tokens_per_s", "ttft_median_s", "tpot_median_s", "engine_hook_ms_per_step")
    medians = {v: {k: median(r, k) for k in keys} for v, r in runs.items()}
    ratios = {
        k: medians["after"][k] / medians["before"][k]
        for k in keys
        if medians["after"][k] and medians["before"][k]
    }
    out = {
        "workload": Path(args.workload).name,
        "threads_per_process": args.threads,
        "pairs": args.pairs,
        "medians": medians,
        "after_over_before": ratios,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_flags": _cpu_flags(),
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({"medians": medians, "after_over_before": ratios}, indent=2))
    return 0


def _cpu_flags() -> str:
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if "flags" in line
        )
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")
    return " ".join(f for f in wanted if f" {f}" in flags)


if __name__ == "__main__":
    sys.exit(main())
