"""Where the engine and the worker's threads run (issue 16 item 1), on the embedded model.

Configurations (executor, worker threads, `parallel.cpu_bind`), each run in its own
process without `OMP_NUM_THREADS`, rounds interleaved with the order rotating:

- `inprocess/2/none`: the default (`LLM()`): the worker in the caller's process, all CPUs,
  threads placed by the OS;
- `inprocess/2/auto`: the same with each OpenMP thread pinned to one CPU (vLLM-CPU's
  `VLLM_CPU_OMP_THREADS_BIND=auto`);
- `inprocess/1/auto`: one worker thread pinned to the last CPU;
- `process/2/none`: the worker in its own process on all CPUs, the engine beside it;
- `process/1/auto`: the engine process left one CPU, the worker pinned to the other.

Two workloads: `small.json` (16 prompts, 32 output tokens each: output tokens/s) and
`latency.json` (one request, 128 in / 128 out: ms per output token after the first).
Medians over rounds, per configuration, and each one's ratio to the default; writes
`benchmarks/results/thread_placement.json` with the CPU flags and the load average.

    python benchmarks/thread_placement.py [--rounds 3]
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
RESULT = ROOT / "results" / "thread_placement.json"
CONFIGS = [
    ("inprocess", 2, "none"),
    ("inprocess", 2, "auto"),
    ("inprocess", 1, "auto"),
    ("process", 2, "none"),
    ("process", 1, "auto"),
]
WORKLOADS = {
    "small": ROOT / "workloads" / "small.json",
    "latency": ROOT / "workloads" / "latency.json",
}


def child(executor: str, threads: int, bind: str, workload: Path) -> dict[str, Any]:
    """One run in this process: build the LLM, warm up, time the workload."""
    from tandem import LLM, SamplingParams

    llm = LLM(executor=executor, worker_num_threads=threads, cpu_bind=bind)
    requests = json.loads(workload.read_text())["requests"]
    prompts = [r["prompt_token_ids"] for r in requests]
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests
    ]
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    first = max(o.metrics.first_token_time for o in outs) if outs[0].metrics else None
    result = {"output_tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed}
    if len(outs) == 1 and first is not None:
        finished = outs[0].metrics.finished_time
        result["ms_per_token"] = 1000 * (finished - first) / max(1, tokens - 1)
    else:
        result["ms_per_token"] = 1000 * elapsed / tokens
    return result


def run_child(config: tuple[str, int, str], workload: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    env["HF_HUB_OFFLINE"] = "1"
    executor, threads, bind = config
    cmd = [sys.executable, __file__, "--child", executor, str(threads), bind, str(workload)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        executor, threads, bind, workload = args.child
        print(json.dumps(child(executor, int(threads), bind, Path(workload))))
        return
    names = ["/".join(map(str, c)) for c in CONFIGS]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        w: {n: [] for n in names} for w in WORKLOADS
    }
    load_before = os.getloadavg()
    for r in range(args.rounds):
        order = CONFIGS[r % len(CONFIGS) :] + CONFIGS[: r % len(CONFIGS)]
        for workload, path in WORKLOADS.items():
            for config in order:
                name = "/".join(map(str, config))
                runs[workload][name].append(run_child(config, path))
                print(workload, name, runs[workload][name][-1], flush=True)
    summary: dict[str, Any] = {}
    for workload, by_config in runs.items():
        metric = "ms_per_token" if workload == "latency" else "tokens_per_s"
        medians = {n: statistics.median(x[metric] for x in rs) for n, rs in by_config.items()}
        base = medians[names[0]]
        summary[workload] = {
            "metric": metric,
            "medians": medians,
            "ratio_to_default": {n: m / base for n, m in medians.items()},
        }
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    result = {
        "command": f"python benchmarks/thread_placement.py --rounds {args.rounds}",
        "cpus": len(os.sched_getaffinity(0)),
        "cpu_flags": [f for f in flags if f.startswith(("avx", "amx", "fma"))],
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "summary": summary,
        "runs": runs,
    }
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
