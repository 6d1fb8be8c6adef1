"""glibc's mmap / trim thresholds against a burst's prefill: 32 prompts of the serve workload
prefilled at once (`max_tokens=1`, 2,048-token steps), one fresh process per setting.

    python benchmarks/heap_thresholds.py [--settings 4/8,8/32,32/64] [--repeats 6]
        [--dtype bfloat16] [--threads 2]

A setting `M/T` runs the child with `MALLOC_MMAP_THRESHOLD_` = M MiB and
`MALLOC_TRIM_THRESHOLD_` = T MiB (so the worker pins nothing: the environment stands,
`core/worker/host_heap.py`); `default` runs it as tandem sets it. Each child warms up on
one burst, then times `--repeats` bursts (fresh token ids each: prefix caching is off
anyway) and reports the median and its page faults per burst. Settings alternate over two
rounds. Writes benchmarks/results/heap_thresholds.json with the CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(repeats: int, dtype: str, threads: int) -> dict[str, float]:
    from tandem import LLM, SamplingParams

    requests = json.loads((ROOT / "benchmarks/workloads/serve.json").read_text())["requests"]
    prompts = [r["prompt_token_ids"] for r in requests[:32]]
    extra = {"dtype": dtype, "quantization": "none"} if dtype == "bfloat16" else {}
    llm = LLM(
        model="default",
        worker_num_threads=threads,
        enable_prefix_caching=False,
        max_model_len=512,
        async_scheduling=False,
        **extra,
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def burst(shift: int) -> None:
        shifted = [[(t + shift) % 49_000 + 10 for t in p] for p in prompts]
        llm.generate(shifted, params, use_tqdm=False)

    burst(1)
    times, faults = [], []
    for i in range(repeats):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        burst(100 + i)
        times.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"median_ms": 1e3 * statistics.median(times), "faults": statistics.median(faults)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="default,4/8,8/32,32/64")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/heap_thresholds.json")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.repeats, args.dtype, args.threads)))
        return
    from tandem.models.cpu_features import cpu_flags, cpu_model_name

    results: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for setting in args.settings.split(","):
            env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
            env["OMP_NUM_THREADS"] = str(args.threads)
            if setting != "default":
                mmap_mib, trim_mib = (int(x) for x in setting.split("/"))
                env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_mib << 20)
                env["MALLOC_TRIM_THRESHOLD_"] = str(trim_mib << 20)
            command = [sys.executable, __file__, "--child", "--repeats", str(args.repeats)]
            command += ["--dtype", args.dtype, "--threads", str(args.threads)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            results.setdefault(setting, []).append(run)
            print(f"{setting:8s} {run['median_ms']:8.1f} ms per burst, {run['faults']:.0f} faults")
    summary = {
        setting: {
            "median_ms": statistics.median(r["median_ms"] for r in runs),
            "faults": statistics.median(r["faults"] for r in runs),
        }
        for setting, runs in results.items()
    }
    document = {
        "cpu": cpu_model_name(),
        "cpu_flags": sorted(cpu_flags()),
        "dtype": args.dtype,
        "threads": args.threads,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "summary": summary,
        "runs": results,
        "load_average": os.getloadavg(),
    }
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
