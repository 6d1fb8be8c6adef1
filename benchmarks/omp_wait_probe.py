"""Batch-1 latency of `LLM.generate` under OpenMP thread counts and wait policies.

    python benchmarks/omp_wait_probe.py [--rounds 2] [--variant NAME=THREADS[:KEY=VALUE,...]]

Each variant runs in its own process (libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT
when it loads), variants alternate order every round: the embedded SmolLM2, a 128-token
prompt, 48 greedy tokens, 3 runs after a warm-up; per run wall ms per output token (TPOT),
TTFT and the process's CPU ms per token, medians per process, and the load average at its
start. CPU ms per token far above wall ms per token means threads spin. Default variants:
1 thread; 2 threads with libgomp's default wait, with GOMP_SPINCOUNT=10000, with
OMP_WAIT_POLICY=PASSIVE. Writes JSON to `--out` (default
benchmarks/results/omp_wait_probe.json) with the CPU flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_compare import cpu_flags  # noqa: E402

CHILD = r"""
import json, sys, time, torch
from tandem import LLM, SamplingParams
t = int(sys.argv[1])
torch.set_num_threads(t)
llm = LLM(worker_num_threads=t, max_model_len=512)
prompt = [100 + (i * 7919) % 30000 for i in range(128)]
params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
runs = []
for _ in range(3):
    cpu = time.process_time()
    m = llm.generate([prompt], params, use_tqdm=False)[0].metrics
    runs.append({"tpot_ms": (m.finished_time - m.first_token_time) * 1000 / 47,
                 "ttft_ms": (m.first_token_time - m.arrival_time) * 1000,
                 "cpu_ms_per_token": (time.process_time() - cpu) * 1000 / 48})
llm.shutdown()
print(json.dumps(runs))
"""

DEFAULT_VARIANTS = [
    "t1=1",
    "t2=2",
    "t2-spin10k=2:GOMP_SPINCOUNT=10000",
    "t2-passive=2:OMP_WAIT_POLICY=PASSIVE",
]


def parse_variant(text: str) -> tuple[str, int, dict[str, str]]:
    """`NAME=THREADS[:KEY=VALUE,...]` -> (name, threads, environment)."""
    name, rest = text.split("=", 1)
    threads, _, env_text = rest.partition(":")
    env = dict(item.split("=", 1) for item in env_text.split(",") if item)
    return name, int(threads), env


def run(threads: int, env: dict[str, str]) -> dict[str, float]:
    full = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", **env}
    full.update({"TRANSFORMERS_OFFLINE": "1"})
    load = os.getloadavg()[0]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(threads)],
        env=full, capture_output=True, text=True, cwd="/", timeout=1800,
    )  # fmt: skip
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:], "load": load}  # type: ignore[dict-item]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"load": load}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variant", action="append", help="NAME=THREADS[:KEY=VALUE,...]")
    p.add_argument("--out", default=str(Path(__file__).parent / "results/omp_wait_probe.json"))
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variant or DEFAULT_VARIANTS]
    results: dict[str, list] = {name: [] for name, _, _ in variants}
    for round_index in range(args.rounds):
        for name, threads, env in variants if round_index % 2 == 0 else variants[::-1]:
            results[name].append(run(threads, env))
            print(name, json.dumps(results[name][-1]), file=sys.stderr, flush=True)
    doc = {
        "what": __doc__.splitlines()[0],
        "cpu": cpu_flags(),
        "variants": {name: {"threads": t, "env": env} for name, t, env in variants},
        "runs": results,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
