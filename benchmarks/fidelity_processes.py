"""How much does one engine process's speed differ from another's on this machine?

    python benchmarks/fidelity_processes.py [--processes 5] [--bursts 3] [--requests 64]
        [--threads 1] [--out benchmarks/results/fidelity_processes.json]

Starts `--processes` fresh Python processes one after another; each builds the embedded
model's real engine (`EngineCore`, synchronous, `--threads` worker threads) and replays
the same burst (`--requests` requests at once, prompts uniform(16,128), outputs
uniform(16,64), fresh prompt ids per burst) `--bursts` times, timing every step's device
part as `tandem simulate calibrate` does (`trace_profile.replay_steps`). Reports each
process's device seconds per burst, the spread within a process (max / min of its bursts)
and between processes (max / min of the per-process medians).

Why: `simulate_fidelity.py` calibrates in one process and measures the engine in others.
A spread between processes much wider than within one means a single calibration carries
its process's speed into the fit, and a prediction compared with another process's
measurement inherits the difference (pool calibrations: `tandem simulate calibrate
--merge`).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent
SPEC = "poisson:rate=inf,n={n},prompt=uniform(16,128),output=uniform(16,64),seed=7"


def child(requests: int, bursts: int, threads: int) -> list[float]:
    """In a fresh process: the engine, then `bursts` replays; device seconds of each."""
    from simulate_fidelity import real_config

    from tandem.core.engine_core import EngineCore
    from tandem.simulate.trace_profile import replay_steps
    from tandem.simulate.traffic import generate, parse_traffic

    config = real_config(False, threads)
    engine = EngineCore(config, source="fidelity_processes")
    seconds = []
    try:
        for k in range(bursts):
            traffic = generate(parse_traffic(SPEC.format(n=requests)), config.max_model_len)
            samples = replay_steps(engine, traffic, 100 + k, "burst", lambda _line: None)
            seconds.append(sum(s.device_s for s in samples))
    finally:
        engine.shutdown()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=5)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "fidelity_processes.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.requests, args.bursts, args.threads)))
        return
    started, load_before = time.monotonic(), os.getloadavg()
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    command = [sys.executable, __file__, "--child", "--requests", str(args.requests)]
    command += ["--bursts", str(args.bursts), "--threads", str(args.threads)]
    runs = []
    for k in range(args.processes):
        done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        bursts = json.loads(done.stdout.strip().splitlines()[-1])
        runs.append(bursts)
        print(f"process {k}: device s per burst {[round(b, 2) for b in bursts]}", flush=True)
    medians = [statistics.median(r) for r in runs]
    within = max(max(r) / min(r) for r in runs)
    between = max(medians) / min(medians)
    print(f"spread within a process (worst): {within:.3f}; between processes: {between:.3f}")
    document = {
        "requests": args.requests,
        "bursts": args.bursts,
        "threads": args.threads,
        "device_s_per_burst": runs,
        "process_medians_s": medians,
        "spread_within_worst": within,
        "spread_between": between,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_s": time.monotonic() - started,
    }
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
