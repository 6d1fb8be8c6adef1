"""Where a step's wall time goes, by phase, at batch 64 (issue 16 item 2).

Two runs on the embedded SmolLM2 (fp32, `LLM()`'s default model and executor, the default
workload's engine settings of `tandem bench`), each in its own process:

- `decode`: 64 requests x 32 prompt tokens x 64 output tokens (greedy, EOS ignored); the
  steps where all 64 requests decode, sync and async scheduling;
- `prefill`: 64 requests x 480 prompt tokens x 1 output token; the steps that run a full
  `max_num_batched_tokens` chunk of prompts.

Each step is split by `step_phases.instrument` (timed wrappers around the real call sites,
in the child process only) into scheduling, input preparation, forward (linears, attention,
other model ops), logits, sampling, output processing and the remainder ("Python
overhead"). Per run: the mean of each phase over the selected steps (means add up: the
phases sum to the mean step). Over `--repeats` runs: the median of each phase's ms/step and
of its share of the step (medians need not add up to exactly 100 %). Absolute times move
with the machine's load; the shares, measured within one process, much less.

    python benchmarks/step_costs.py [--repeats 3] [--modes async,sync,prefill]
    python benchmarks/step_costs.py --child decode-async   # one run, JSON on stdout

Writes benchmarks/results/step_costs.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_phases import CATEGORY, MODEL_COMPUTE, instrument, wrapper_cost_s  # noqa: E402

ROOT = Path(__file__).resolve().parent
ENGINE = {  # the default workload's engine section (tandem bench, benchmarks/workloads)
    "max_num_seqs": 64,
    "max_model_len": 1024,
    "max_num_batched_tokens": 2048,
    "enable_prefix_caching": False,
    "kv_cache_memory_gib": 2,
}
#: mode -> (requests, prompt tokens, output tokens, async scheduling)
MODES: dict[str, tuple[int, int, int, bool]] = {
    "decode-async": (64, 32, 64, True),
    "decode-sync": (64, 32, 64, False),
    "prefill": (64, 480, 1, True),
}
#: Selected steps skipped at the start of each run (first decodes after the prefill).
SKIP_STEPS = 2


def prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random ids of SmolLM2's ordinary vocabulary, 100..40000 (as `tandem bench` draws
    them), within `vocab`."""
    rng = random.Random(seed)
    low, high = min(100, vocab // 2), min(40_000, vocab - 1)
    return [[rng.randint(low, high) for _ in range(length)] for _ in range(num)]


def profile(llm: Any, batch: list[list[int]], max_tokens: int) -> tuple[list[Any], int]:
    """Run `batch` through `llm.generate` instrumented; return the steps
    (`step_phases.Step`) and the number of timed calls."""
    from tandem import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    warmup = prompts(1, 16, llm.engine.vocab_size, seed=1)
    llm.generate(warmup, SamplingParams(max_tokens=4), use_tqdm=False)
    with instrument(llm) as clock:
        llm.generate(batch, params, use_tqdm=False)
    return clock.steps, clock.calls


def summarise_steps(steps: list[Any], calls_per_step: float = 0.0) -> dict[str, Any]:
    """Mean ms per phase over `steps` (all non-negative; they sum to `step_ms`), shares of
    the step, and the per-category totals."""
    if not steps:
        raise ValueError("no step matched (workload or engine settings changed?)")
    names = sorted({name for s in steps for name in s.phases}, key=list(CATEGORY).index)
    n = len(steps)
    phase_ms = {k: 1000 * sum(s.phases.get(k, 0.0) for s in steps) / n for k in names}
    step_ms = 1000 * sum(s.wall_s for s in steps) / n
    categories: dict[str, float] = {}
    for name, ms in phase_ms.items():
        categories[CATEGORY[name]] = categories.get(CATEGORY[name], 0.0) + ms
    return {
        "steps": n,
        "step_ms": step_ms,
        "phase_ms": phase_ms,
        "phase_pct": {k: 100 * v / step_ms for k, v in phase_ms.items()},
        "category_ms": categories,
        "category_pct": {k: 100 * v / step_ms for k, v in categories.items()},
        "timed_calls_per_step": calls_per_step,
    }


def measure(
    mode: str,
    model: str = "default",
    num: int | None = None,
    max_tokens: int | None = None,
    **engine: Any,
) -> dict[str, Any]:
    """One run of `mode` in this process (see the module docstring); `num` and
    `max_tokens` override the mode's request count and output length."""
    from tandem import LLM

    default_num, length, default_max, use_async = MODES[mode]
    num, max_tokens = num or default_num, max_tokens or default_max
    llm = LLM(model=model, async_scheduling=use_async, **(ENGINE | engine))
    try:
        budget = llm.config.scheduler.max_num_batched_tokens
        start_calls = time.perf_counter()
        steps, calls = profile(llm, prompts(num, length, llm.engine.vocab_size), max_tokens)
        wall_s = time.perf_counter() - start_calls
        if mode == "prefill":
            chosen = [s for s in steps if s.is_full_prefill(budget)]
        else:
            chosen = [s for s in steps if s.is_decode(num)][SKIP_STEPS:]
        summary = summarise_steps(chosen, calls / max(len(steps), 1))
        summary |= {
            "mode": mode,
            "executor": llm.config.parallel.executor,
            "async_scheduling": llm.config.scheduler.async_scheduling,
            "worker_threads": llm.config.parallel.worker_num_threads,
            "requests": num,
            "prompt_tokens": length,
            "max_tokens": max_tokens,
            "vocab_size": llm.engine.vocab_size,
            "all_steps": len(steps),
            "generate_s": wall_s,
            "tokens_per_step": budget if mode == "prefill" else num,
            "wrapper_cost_us": 1e6 * wrapper_cost_s(),
        }
        return summary
    finally:
        llm.shutdown()


def machine() -> dict[str, Any]:
    flags: set[str] = set()
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
        elif key.strip() == "model name":
            model = value.strip()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")
    return {"cpu": model, "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags]}


def _median_of(runs: list[dict[str, Any]], group: str) -> dict[str, float]:
    keys = {k for r in runs for k in r[group]}
    return {k: statistics.median(r[group].get(k, 0.0) for r in runs) for k in keys}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over runs of one mode."""
    out = {
        "runs": len(runs),
        "step_ms": statistics.median(r["step_ms"] for r in runs),
        "steps_per_run": [r["steps"] for r in runs],
    }
    for group in ("phase_ms", "phase_pct", "category_ms", "category_pct"):
        out[group] = _median_of(runs, group)
    return out


def flags_over_5pct(result: dict[str, Any]) -> list[str]:
    """Phases over 5 % of a step that are not the model's own compute."""
    return sorted(k for k, pct in result["phase_pct"].items() if pct > 5 and k not in MODEL_COMPUTE)


def table(results: dict[str, dict[str, Any]]) -> str:
    modes = list(results)
    lines = ["phase | category | " + " | ".join(f"{m} ms | {m} %" for m in modes)]
    for name, category in CATEGORY.items():
        cells = []
        for m in modes:
            ms, pct = results[m]["phase_ms"].get(name), results[m]["phase_pct"].get(name)
            cells.append("- | -" if ms is None else f"{ms:.2f} | {pct:.1f}")
        lines.append(f"{name} | {category} | " + " | ".join(cells))
    lines.append("step | | " + " | ".join(f"{results[m]['step_ms']:.2f} | 100" for m in modes))
    return "\n".join(lines)


def run_child(mode: str, options: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, __file__, "--child", mode, "--options", json.dumps(options)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="decode-async,decode-sync,prefill")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "step_costs.json")
    parser.add_argument("--threads", type=int, help="worker_num_threads (default: LLM's)")
    parser.add_argument("--decode-tokens", type=int, help="output tokens of the decode runs")
    parser.add_argument("--prefill-requests", type=int, help="requests of the prefill run")
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, **json.loads(args.options))))
        return 0
    common = {"worker_num_threads": args.threads} if args.threads else {}
    options = {
        mode: common
        | ({"num": args.prefill_requests} if mode == "prefill" else {})
        | ({"max_tokens": args.decode_tokens} if mode != "prefill" else {})
        for mode in MODES
    }
    options = {m: {k: v for k, v in o.items() if v is not None} for m, o in options.items()}
    modes = args.modes.split(",")
    load = {"start": os.getloadavg()}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            runs[mode].append(run_child(mode, options[mode]))
    load["end"] = os.getloadavg()
    results = {m: aggregate(rs) for m, rs in runs.items()}
    for result in results.values():
        result["over_5pct_not_model_compute"] = flags_over_5pct(result)
    out = {
        "what": __doc__.splitlines()[0],
        "command": "python benchmarks/step_costs.py " + " ".join(sys.argv[1:]),
        "machine": machine() | {"load_average": load},
        "medians": results,
        "table": table(results),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(out["table"])
    print(json.dumps({m: r["over_5pct_not_model_compute"] for m, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
