"""The worker's default thread count against hand-set ones, on the embedded model.

`LLM()` with no thread option (the worker resolves `OMP_NUM_THREADS`, else the CPUs this
process may use) against `LLM(worker_num_threads=N)` for each N of `--threads`, on
`benchmarks/workloads/small.json` (16 prompts of 19-128 tokens, 32 greedy output tokens
each, `ignore_eos`). Every run is its own subprocess with `OMP_NUM_THREADS` removed from
its environment, so the default run resolves from the CPU affinity exactly as a user's
`LLM()` would. Rounds interleave the configurations (the order rotates each round), and
the result is the median over rounds of each configuration's output tokens per second;
`default_over_best` is the default's median over the best hand-set median (target: at
least 0.95). Writes benchmarks/results/threads.json with the CPU flags and load average.
`--passive` adds a fourth configuration, the default with `OMP_WAIT_POLICY=PASSIVE` in the
environment (OpenMP threads sleep at barriers instead of spinning), reported beside the
others and not counted as a hand-set thread count.

    python benchmarks/bench_threads.py [--rounds 5] [--threads 1 2] [--passive]
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

ROOT = Path(__file__).resolve().parent
WORKLOAD = ROOT / "workloads" / "small.json"
RESULT = ROOT / "results" / "threads.json"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def child(threads: int | None, workload: Path) -> dict[str, Any]:
    """One run in this process: build the LLM, warm up, time the workload."""
    import torch

    from tandem import LLM, SamplingParams

    options = {} if threads is None else {"worker_num_threads": threads}
    llm = LLM(**options)
    requests = json.loads(workload.read_text())["requests"]
    prompts = [r["prompt_token_ids"] for r in requests]
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests
    ]
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {
        "option": "default" if threads is None else f"worker_num_threads={threads}",
        "resolved_threads": llm.config.parallel.worker_num_threads,
        "resolved_from": llm.config.parallel.worker_threads_from,
        "torch_threads_after": torch.get_num_threads(),
        "output_tokens": tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": tokens / elapsed,
    }


PASSIVE = "default, OMP_WAIT_POLICY=PASSIVE"


def run_child(config: int | str | None, workload: Path) -> dict[str, Any]:
    """One run in a fresh process without OMP_NUM_THREADS: `config` is None (the default),
    a hand-set thread count, or `PASSIVE`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["HF_HUB_OFFLINE"] = "1"
    if config == PASSIVE:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    threads = config if isinstance(config, int) else None
    cmd = [sys.executable, __file__, "--child", "default" if threads is None else str(threads)]
    cmd += ["--workload", str(workload)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if config == PASSIVE:
        result["option"] = PASSIVE
    return result


def cpu_flags() -> dict[str, bool]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    flags = set()
    for line in text.splitlines():
        if line.startswith("Flags:"):
            flags = set(line.split(":", 1)[1].split())
    return {flag: flag in flags for flag in CPU_FLAGS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workload", type=Path, default=WORKLOAD)
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--passive", action="store_true", help="also the default, passive")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        threads = None if args.child == "default" else int(args.child)
        print(json.dumps(child(threads, args.workload)))
        return
    configs: list[int | str | None] = [None, *args.threads] + ([PASSIVE] if args.passive else [])
    load_before = os.getloadavg()
    rounds = []
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        results = {}
        for threads in order:
            result = run_child(threads, args.workload)
            results[result["option"]] = result
            print(json.dumps({"round": r, **result}), flush=True)
        rounds.append(results)
    names = list(rounds[0])
    medians = {n: statistics.median(rd[n]["output_tokens_per_s"] for rd in rounds) for n in names}
    hand_set = {n: v for n, v in medians.items() if n.startswith("worker_num_threads=")}
    best = max(hand_set, key=lambda n: hand_set[n])
    per_round = [
        rd["default"]["output_tokens_per_s"] / rd[best]["output_tokens_per_s"] for rd in rounds
    ]
    result = {
        "workload": str(args.workload.relative_to(ROOT.parent)),
        "cpus_this_process_may_use": len(os.sched_getaffinity(0)),
        "default_resolved_threads": rounds[0]["default"]["resolved_threads"],
        "default_resolved_from": rounds[0]["default"]["resolved_from"],
        "output_tokens_per_s_median": medians,
        "best_hand_set": best,
        "default_over_best": medians["default"] / medians[best],
        "default_over_best_per_round": per_round,
        "target": 0.95,
        "passive_default_over_best": medians[PASSIVE] / medians[best]
        if PASSIVE in medians
        else None,
        "cpu_flags": cpu_flags(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "engine": "LLM() defaults: in-process executor, async scheduling, fp32",
        "rounds": rounds,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = ("output_tokens_per_s_median", "best_hand_set", "default_over_best")
    print(json.dumps({k: result[k] for k in (*summary, "load_average_after")}))


if __name__ == "__main__":
    main()
