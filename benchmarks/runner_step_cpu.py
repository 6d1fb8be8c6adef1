"""CPU time the model runner spends preparing one decode step of 64 requests, before/after.

Measured on the scripted model (no weights), in-process executor, one torch thread, for
sync and async scheduling. Per step that decodes all 64 requests it records, as thread CPU
time:

- `prep_ms`: `execute_model` from entry to the call of the model's `forward` (request
  state updates and building the flattened inputs: ids, positions, slots, block tables,
  logits indices; under async the device-side fill of the previous step's ids);
- `metadata_ms`: the runner's `_sampling_metadata` (the sampler's per-row parameters).

Both are found by wrapping the runner's methods by name, so the same file measures any
version whose runner has `execute_model`, `_sampling_metadata` and `model.forward`.

    python benchmarks/runner_step_cpu.py            # this tree vs /tmp/before_pkg, 3 rounds
    python benchmarks/runner_step_cpu.py --child    # one measurement, JSON on stdout

The driver copies this file to a temporary directory and runs it there, alternately with
`PYTHONPATH=<before>` (a directory whose `tandem` package is the code before the change)
and without (the installed tree), `--rounds` times; each figure is the median over the
rounds of each run's median step. Results go to `benchmarks/results/runner_step_cpu.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NUM_REQUESTS = 64
PROMPT_LEN = (150, 250)
MAX_TOKENS = 120
WARMUP_STEPS = 5


def measure(async_scheduling: bool) -> dict[str, float]:
    """Median CPU ms per full-batch decode step of input preparation and metadata."""
    import torch

    from tandem.testing import make_request, make_scripted_engine

    torch.set_num_threads(1)
    engine = make_scripted_engine(
        async_scheduling=async_scheduling,
        check_invariants=False,
        max_num_seqs=NUM_REQUESTS,
        max_num_batched_tokens=NUM_REQUESTS * PROMPT_LEN[1],
        max_model_len=1024,
        block_size=16,
        num_kv_blocks=NUM_REQUESTS * 32,
    )
    runner = engine.executor.worker.model_runner
    prep: list[float] = []
    metadata: list[float] = []
    clock = time.thread_time_ns
    state: dict[str, Any] = {"start": None}

    execute_model = runner.execute_model
    forward = runner.model.forward
    sampling_metadata = runner._sampling_metadata

    def timed_execute(so: Any) -> Any:
        full_decode = len(so.num_scheduled_tokens) == NUM_REQUESTS and (
            so.total_num_scheduled_tokens == NUM_REQUESTS
        )
        state["start"] = clock() if full_decode else None
        return execute_model(so)

    def timed_forward(batch: Any) -> Any:
        if state["start"] is not None:
            prep.append((clock() - state["start"]) / 1e6)
            state["start"] = None
        return forward(batch)

    def timed_metadata(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        result = sampling_metadata(*args, **kwargs)
        if len(result.temperature) == NUM_REQUESTS:
            metadata.append((clock() - start) / 1e6)
        return result

    runner.execute_model = timed_execute
    runner.model.forward = timed_forward
    runner._sampling_metadata = timed_metadata
    rng = random.Random(0)
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(2, 128) for _ in range(rng.randint(*PROMPT_LEN))]
        engine.add_request(make_request(f"r{i}", prompt, max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.run_until_idle()
    prep, metadata = prep[WARMUP_STEPS:], metadata[WARMUP_STEPS:]
    return {
        "prep_ms": statistics.median(prep),
        "metadata_ms": statistics.median(metadata),
        "steps": len(prep),
    }


def child() -> None:
    import tandem

    result = {
        "tandem": tandem.__file__,
        "sync": measure(async_scheduling=False),
        "async": measure(async_scheduling=True),
    }
    print(json.dumps(result))


def run_child(script: Path, pythonpath: str | None) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, str(script), "--child"],
        env=env,
        cwd=script.parent,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"tandem": runs[0]["tandem"]}
    for mode in ("sync", "async"):
        summary[mode] = {
            key: statistics.median(run[mode][key] for run in runs)
            for key in ("prep_ms", "metadata_ms")
        }
        summary[mode]["steps_per_run"] = runs[0][mode]["steps"]
        summary[mode]["per_round"] = [
            {k: round(run[mode][k], 4) for k in ("prep_ms", "metadata_ms")} for run in runs
        ]
    return summary


def cpu_description() -> dict[str, Any]:
    """The CPU model and its vector extensions (figures differ between AVX2 and AVX-512)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    vector = sorted(f for f in flags if f.startswith(("avx2", "avx512f", "avx512_bf16", "amx")))
    return {"cpu": model, "cores": os.cpu_count(), "vector_flags": vector}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help="measure once, print JSON")
    parser.add_argument("--before", default="/tmp/before_pkg", help="PYTHONPATH of the old code")
    parser.add_argument("--rounds", type=int, default=3)
    default_out = Path(__file__).resolve().parent / "results" / "runner_step_cpu.json"
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args()
    if args.child:
        child()
        return
    load = {"start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "runner_step_cpu.py"
        shutil.copy(__file__, script)
        before: list[dict[str, Any]] = []
        after: list[dict[str, Any]] = []
        for _ in range(args.rounds):
            before.append(run_child(script, args.before))
            after.append(run_child(script, None))
    load["end"] = os.getloadavg()
    result = {
        "what": "median thread-CPU ms per decode step of 64 requests on the scripted model: "
        "runner input preparation (execute_model up to the forward) and sampling metadata",
        "rounds": args.rounds,
        "machine": {**cpu_description(), "load_average": load, "torch_threads": 1},
        "before": summarise(before),
        "after": summarise(after),
    }
    for mode in ("sync", "async"):
        result[f"{mode}_after_over_before"] = {
            key: round(result["after"][mode][key] / result["before"][mode][key], 3)
            for key in ("prep_ms", "metadata_ms")
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
