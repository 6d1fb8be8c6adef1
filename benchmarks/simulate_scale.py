"""Scale and speed of `tandem simulate`: one simulated hour of Llama-3-8B on one H200.

Poisson arrivals at 20 requests/s for `--duration` simulated seconds (3,600: about 72,000
requests), lognormal prompts (mean 1,024 tokens) and uniform outputs (32-512 tokens), the
reference scheduler under async scheduling (the stack `examples/simulate/fcfs-async.yaml`
when present, else the defaults below), the roofline cost model. Reports simulated seconds
per wall second and where the wall time goes: a sampling profile of the run split into the
scheduler plugins, the kernel loop, the token oracle, the cost model, the driver's
bookkeeping and the rest (`--profile`, which slows the run by about 1.5x, so the speed
figure comes from a separate unprofiled run).

    python benchmarks/simulate_scale.py [--duration 3600] [--rate 20] [--profile]

Writes benchmarks/results/simulate_scale.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import time
from pathlib import Path

from tandem.core.worker.virtual_device import EngineTime
from tandem.simulate.cli import parser as cli_parser
from tandem.simulate.cli import stack_config
from tandem.simulate.driver import simulate
from tandem.simulate.report import Slo, summarize
from tandem.simulate.traffic import generate, parse_traffic

ROOT = Path(__file__).resolve().parent.parent
STACK = """
scheduler: {max_num_seqs: 256, max_num_batched_tokens: 8192, async_scheduling: true}
cache: {block_size: 16, enable_prefix_caching: true}
"""

#: Where a profiled function's file puts its time (first match wins).
BUCKETS = (
    ("scheduler plugins", ("plugins/", "kv/")),
    ("token oracle", ("token_oracle.py",)),
    ("cost model", ("cost_models/", "step_shape.py")),
    ("kernel loop", ("core/",)),
    ("driver and report", ("simulate/",)),
)


def where_time_goes(stats: pstats.Stats) -> dict[str, float]:
    """Self time per bucket, as fractions of the profiled total."""
    totals: dict[str, float] = {}
    for (filename, _, _), (_, _, self_time, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        bucket = next((b for b, keys in BUCKETS if any(k in filename for k in keys)), "other")
        totals[bucket] = totals.get(bucket, 0.0) + self_time
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=3600.0)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/simulate_scale.json")
    args = p.parse_args()
    stack = ROOT / "examples/simulate/fcfs-async.yaml"
    if not stack.exists():
        stack = Path("/tmp/tandem-simulate-scale.yaml")
        stack.write_text(STACK)
    cli_args = cli_parser().parse_args(
        ["--stack", str(stack), "--traffic", "-", "--model", "llama-3-8b", "--device", "h200"]
    )
    config = stack_config(str(stack), cli_args)
    spec = parse_traffic(
        f"poisson:rate={args.rate},duration={args.duration},"
        "prompt=lognormal(1024,0.8),output=uniform(32,512),seed=0"
    )
    engine_time = EngineTime(step_s=5e-4, per_request_s=2e-5)
    start = time.perf_counter()
    traffic = generate(spec, cli_args.max_model_len)
    generate_s = time.perf_counter() - start
    result = simulate(config, traffic, engine_time=engine_time)
    summary = summarize(
        result.timelines,
        duration_s=result.duration_s,
        slo=Slo(ttft_ms=2000, tpot_ms=100),
        usage=result.usage,
        device_busy_s=result.busy_s,
        num_preemptions=result.num_preemptions,
    )
    document = {
        "machine": platform.processor() or platform.machine(),
        "stack": str(stack.relative_to(ROOT)) if stack.is_relative_to(ROOT) else STACK,
        "traffic": f"poisson rate={args.rate} duration={args.duration}",
        "requests": len(traffic),
        "steps": result.num_steps,
        "simulated_s": result.duration_s,
        "wall_s": result.wall_s,
        "traffic_generation_s": generate_s,
        "simulated_s_per_wall_s": result.duration_s / result.wall_s,
        "wall_us_per_request_step": 1e6
        * result.wall_s
        / max(sum(len(t.token_times_s) for t in result.timelines), 1),
        "summary": {k: v for k, v in summary.items() if k != "usage"},
    }
    if args.profile:
        profiler = cProfile.Profile()
        short = [t for t in traffic if t.arrival_s < min(args.duration, 120.0)]
        profiler.runcall(simulate, config, short, engine_time=engine_time)
        document["profile_120s_self_time_fractions"] = where_time_goes(pstats.Stats(profiler))
    args.out.write_text(json.dumps(document, indent=1))
    print(json.dumps({k: v for k, v in document.items() if k != "summary"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
