"""Where a calibrated fit misses the real engine, step by step.

    python benchmarks/fidelity_steps.py [--rate 2.5] [--requests 96] [--threads 1]
        [--fit benchmarks/results/simulate_fidelity_fit.json] [--out /tmp/fidelity_steps.json]

Replays `simulate_fidelity.py`'s trace (Poisson arrivals, prompts uniform(16,128), outputs
uniform(16,64), seed 0) at one rate into an in-process `EngineCore` of the embedded model
on the real clock (`tandem.simulate.trace_profile.replay_steps`, as `tandem simulate
calibrate --traffic` does), times every step's device part as the calibration does
(`StepTimer`: the executor's execute and sample calls) and prices the same step shape
with the fit. Prints, per kind of step (pure decode by batch size, pure prefill, mixed),
the count, the measured and predicted seconds and the median measured / predicted ratio;
writes every step to `--out`.

A kind whose ratio is far from 1 while the others are near it is a shape the fit's
features do not describe (a kernel that changes strategy at some batch size, say); a
common offset on every kind is the machine's speed against the calibration's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simulate_fidelity import prompt_seed, real_config, traffic_at  # noqa: E402

from tandem.core.engine_core import EngineCore  # noqa: E402
from tandem.plugins.cost_models.calibrated import load_fit  # noqa: E402
from tandem.simulate.trace_profile import replay_steps  # noqa: E402

ROOT = Path(__file__).resolve().parent
#: (label, lowest, highest) decode batch sizes reported apart.
DECODE_BANDS = ((1, 4), (5, 8), (9, 16), (17, 64))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=2.5)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--async-scheduling", action="store_true", help="replay under async")
    p.add_argument("--fit", type=Path, default=ROOT / "results" / "simulate_fidelity_fit.json")
    p.add_argument("--out", type=Path, default=Path("/tmp/fidelity_steps.json"))
    args = p.parse_args()
    trace = argparse.Namespace(requests=args.requests, prompt="16,128", output="16,64", seed=0)
    config = real_config(args.async_scheduling, args.threads)
    traffic = traffic_at(trace, args.rate, config.max_model_len)
    fit = load_fit(args.fit)
    engine = EngineCore(config, source="fidelity_steps")
    try:
        started = time.monotonic()
        samples = replay_steps(engine, traffic, prompt_seed(trace, args.rate, [args.rate]))
        wall = time.monotonic() - started
    finally:
        engine.shutdown()
    print(f"replay wall {wall:.2f} s (warm-up included), {len(samples)} steps")
    rows = []
    for s in samples:
        queries = s.shape.query_lens
        rows.append(
            {
                "prefill_tokens": sum(q for q in queries if q > 1),
                "decodes": sum(1 for q in queries if q == 1),
                "context_tokens": sum(s.shape.context_lens),
                "device_s": s.device_s,
                "engine_s": s.engine_s,
                "predicted_s": fit.device_seconds(s.shape),
            }
        )
    kinds: dict[str, list[dict[str, Any]]] = {
        "every step": rows,
        "pure prefill": [r for r in rows if not r["decodes"]],
        "mixed": [r for r in rows if r["decodes"] and r["prefill_tokens"]],
    }
    for low, high in DECODE_BANDS:
        kinds[f"decode batch {low}-{high}"] = [
            r for r in rows if not r["prefill_tokens"] and low <= r["decodes"] <= high
        ]
    summary = {}
    for kind, chosen in kinds.items():
        ratios = [r["device_s"] / r["predicted_s"] for r in chosen if r["predicted_s"] > 0]
        if not ratios:
            continue
        summary[kind] = {
            "steps": len(chosen),
            "measured_s": sum(r["device_s"] for r in chosen),
            "predicted_s": sum(r["predicted_s"] for r in chosen),
            "median_measured_over_predicted": statistics.median(ratios),
        }
        row = summary[kind]
        print(
            f"{kind:22s} {row['steps']:5d} steps  measured {row['measured_s']:7.2f} s  "
            f"predicted {row['predicted_s']:7.2f} s  median ratio "
            f"{row['median_measured_over_predicted']:.3f}"
        )
    args.out.write_text(json.dumps({"rate": args.rate, "summary": summary, "steps": rows}) + "\n")


if __name__ == "__main__":
    main()
