"""Scheduling policies side by side on a simulated H200: capacity under an SLO, by rate sweep.

Runs the stacks of `examples/simulate/` through `tandem simulate`'s Python API (the same
`stack_config`, `generate`, `simulate` and `summary_of` as the CLI) on one bursty trace:

- model and device: Llama-3-8B (bf16) on one H200, the `roofline-cost` plugin
  (`--model llama-3-8b --device h200`), a KV pool sized at 90% of the H200's memory
  unless a stack file gives `num_kv_blocks`; engine CPU time `modelled` at the CLI's
  default (0.5 ms per step + 20 us per scheduled request);
- traffic: `TRAFFIC` below: Gamma arrivals with cv=3 (bursty), lognormal prompts (mean
  1,500 tokens) and outputs (mean 250), 3 priority classes drawn uniformly (0 first under
  the priority policy), 8 shared 512-token prefixes; `--duration` seconds of arrivals;
  one seed, so every stack sees the same requests at a rate, and request i has the same
  shape at every rate (a higher rate scales the same gaps down, and more fit in the
  duration);
- SLO: a request meets it when TTFT <= 2 s and TPOT <= 100 ms; a rate is met when at
  least 90% of the completed requests meet it (`slo_attainment >= 0.9`);
- capacity: each stack runs its grid of rates (2 req/s apart) in increasing order up to
  the first rate it fails, then the midpoint between that rate and the last one met; its
  capacity is `report.max_rate_under_slo` of those points (the highest rate met with
  every lower one met; rates past a failure would not count anyway), 1 req/s resolution.
  `first_failed` is the lowest rate it failed;
- at one common rate per group (`--common-rate`; default: the capacity of the group's
  first async FCFS stack, the vLLM-default one) every stack of the group is also
  summarised in full, with TTFT per priority class from the timelines (request `sim-i` is
  the i-th traffic entry).

The main group is H200-scale (the KV pool never fills, so the victim seam is never called);
the `smallkv` group repeats FCFS and LRW with a 6,144-block pool (98k tokens), where KV,
not `max_num_seqs`, limits the batch and requests are preempted.

    python benchmarks/simulate_policies.py [--duration 90] [--common-rate R] [--groups h200,smallkv]
        [--smoke] [--replot]

Writes benchmarks/results/simulate_policies.json and .png (`--smoke`: a few seconds of
traffic, two rates, written under /tmp; `--replot`: the PNG again from the JSON). Needs
`examples/tandem-srpt` and `examples/tandem-lrw` installed (`pip install --no-deps --no-build-isolation -e ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from tandem.bench_serve_report import stats_ms
from tandem.simulate.cli import parse_engine_time, parser, stack_config, summary_of
from tandem.simulate.driver import SimulationResult, simulate
from tandem.simulate.report import (
    RequestTimeline,
    Slo,
    is_completed,
    latency_samples,
    max_rate_under_slo,
    meets_slo,
)
from tandem.simulate.traffic import TrafficRequest, generate, parse_traffic

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
STACK_DIR = REPO / "examples" / "simulate"

TRAFFIC = (
    "gamma:rate={rate},cv=3,duration={duration},prompt=lognormal(1500,0.6,6000),"
    "output=lognormal(250,0.5,1000),priorities=3,prefix_groups=8,prefix=512,seed=0"
)
MODEL, DEVICE, MAX_MODEL_LEN = "llama-3-8b", "h200", 8192
ENGINE_TIME = "modelled:step=0.0005,per_request=0.00002"
SLO = Slo(ttft_ms=2000.0, tpot_ms=100.0)
MIN_ATTAINMENT = 0.9

#: group -> (stack names, the first being the group's baseline; rate grid in req/s)
GROUPS: dict[str, tuple[list[str], list[float]]] = {
    "h200": (
        ["fcfs-async", "fcfs-sync", "priority-async", "srpt-async", "lrw-async"],
        [16, 18, 20, 22, 24, 26, 28, 30, 32],
    ),
    "smallkv": (
        ["fcfs-async-smallkv", "lrw-async-smallkv"],
        [12, 14, 16, 18, 20, 22, 24],
    ),
}


def cli_args() -> argparse.Namespace:
    """The `tandem simulate` arguments `stack_config` reads (model, device, lengths)."""
    args = parser().parse_args(
        ["--stack", "-", "--traffic", "-", "--model", MODEL, "--device", DEVICE,
         "--max-model-len", str(MAX_MODEL_LEN), "--engine-time", ENGINE_TIME]
    )  # fmt: skip
    args.engine_time = parse_engine_time(args.engine_time)
    return args


def traffic(rate: float, duration: float) -> list[TrafficRequest]:
    return generate(parse_traffic(TRAFFIC.format(rate=rate, duration=duration)), MAX_MODEL_LEN)


def per_class(result: SimulationResult, requests: list[TrafficRequest]) -> dict[str, Any]:
    """TTFT (ms: mean, p50, p90, p99) and SLO attainment per priority class of the completed
    requests; timeline `sim-i` is `requests[i]` (the driver numbers arrivals in order)."""
    classes: dict[int, list[RequestTimeline]] = {}
    for t in result.timelines:
        if is_completed(t):
            priority = requests[int(t.request_id.removeprefix("sim-"))].priority
            classes.setdefault(priority, []).append(t)
    return {
        str(priority): {
            "completed": len(timelines),
            "ttft_ms": stats_ms([v / 1000 for v in latency_samples(timelines)["ttft_ms"]]),
            "slo_attainment": sum(meets_slo(t, SLO) for t in timelines) / len(timelines),
        }
        for priority, timelines in sorted(classes.items())
    }


def run(
    config: Any, args: argparse.Namespace, rate: float, duration: float
) -> tuple[dict[str, Any], list[float]]:
    """One simulation: its summary (with `num_requests` and `ttft_by_priority`) and its TTFT
    samples in ms."""
    requests = traffic(rate, duration)
    result = simulate(config, requests, engine_time=args.engine_time, seed=0)
    summary = summary_of(result, SLO)
    summary["num_requests"] = len(requests)
    summary["ttft_by_priority"] = per_class(result, requests)
    return summary, latency_samples(result.timelines)["ttft_ms"]


def short(summary: dict[str, Any]) -> str:
    ttft, tpot = summary["ttft_ms"], summary["tpot_ms"]
    return (
        f"attain {summary['slo_attainment']:.3f}  ttft p50/p90 {ttft['p50']:.0f}/{ttft['p90']:.0f} ms"
        f"  tpot p50/p90 {tpot['p50']:.1f}/{tpot['p90']:.1f} ms  preempt "
        f"{summary['num_preemptions']}  ({summary['num_requests']} req, {summary['wall_s']:.1f} s)"
    )


def sweep(
    config: Any, args: argparse.Namespace, name: str, rates: list[float], duration: float
) -> tuple[list[dict[str, Any]], dict[float, list[float]], float | None, float | None]:
    """Rates in increasing order until the first one the stack fails, then the midpoint
    between the last rate met and that one: the points (by rate), their TTFT samples by
    rate, the capacity (`max_rate_under_slo`) and the lowest failed rate."""
    points: list[dict[str, Any]] = []
    samples: dict[float, list[float]] = {}

    def point(rate: float) -> bool:
        summary, samples[rate] = run(config, args, rate, duration)
        points.append({"rate": rate, **summary})
        print(f"{name:>20} @ {rate:5.1f}/s  {short(summary)}", flush=True)
        return summary["slo_attainment"] >= MIN_ATTAINMENT

    met = None
    for rate in sorted(rates):
        if not point(rate):
            if met is not None and rate - met > 1:
                point((met + rate) / 2)
            break
        met = rate
    points.sort(key=lambda p: p["rate"])
    capacity = max_rate_under_slo([(p["rate"], p) for p in points], MIN_ATTAINMENT)
    failed = [p["rate"] for p in points if p["slo_attainment"] < MIN_ATTAINMENT]
    return points, samples, capacity, min(failed, default=None)


def plot(document: dict[str, Any], png: Path) -> None:
    """Attainment and TTFT p90 against rate (every stack; the small-KV group dashed), and
    at the first group's common rate its TTFT CDFs and TTFT p90 per priority class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    stacks = document["stacks"]
    first = next(iter(document["common_rate"]))
    rate = document["common_rate"][first]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    (att, ttft), (cdf, cls) = axes
    main = [name for name, data in stacks.items() if data["group"] == first]
    for n, (name, data) in enumerate(stacks.items()):
        style = ("-" if name in main else "--") + "osv^Dx"[n % 6]  # identical curves stay visible
        rates = [point["rate"] for point in data["sweep"]]
        capacity = data["capacity_rate"]
        label = f"{name} (capacity {'-' if capacity is None else format(capacity, 'g')})"
        attained = [point["slo_attainment"] for point in data["sweep"]]
        att.plot(rates, attained, style, color=f"C{n}", label=label, mfc="none")
        p90 = [point["ttft_ms"]["p90"] / 1000 for point in data["sweep"]]
        ttft.plot(rates, p90, style, color=f"C{n}", label=name, mfc="none")
        values = data["common"]["ttft_samples_ms"]
        if values and name in main:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            cdf.step(
                [v / 1000 for v in values],
                ys,
                where="post",
                color=f"C{n}",
                label=name,
                ls=["-", (0, (5, 2)), (0, (1, 1)), (0, (6, 2, 1, 2)), (0, (2, 3))][n % 5],
            )
    width = 0.8 / max(1, len(main))
    for n, name in enumerate(main):
        by = stacks[name]["common"]["ttft_by_priority"]
        xs = [int(c) + (n - (len(main) - 1) / 2) * width for c in by]
        cls.bar(xs, [by[c]["ttft_ms"]["p90"] / 1000 for c in by], width, color=f"C{n}", label=name)
    att.axhline(MIN_ATTAINMENT, color="k", lw=0.8, ls=":")
    for ax in (ttft, cdf, cls):
        (ax.axvline if ax is cdf else ax.axhline)(SLO.ttft_ms / 1000, color="k", lw=0.8, ls=":")
    att.set(
        title="SLO attainment (TTFT <= 2 s and TPOT <= 100 ms)",
        xlabel="offered rate (req/s)",
        ylabel="fraction of completed requests",
        ylim=(0, 1.02),
    )
    ttft.set(title="TTFT p90", xlabel="offered rate (req/s)", ylabel="seconds", yscale="log")
    cdf.set(
        title=f"TTFT CDF at {rate:g} req/s",
        xlabel="TTFT (s)",
        ylabel="fraction of completed requests",
        xscale="log",
        ylim=(0, 1.02),
    )
    cls.set(
        title=f"TTFT p90 by priority class at {rate:g} req/s (0 = most important)",
        xlabel="priority class (traffic's priorities=3)",
        ylabel="seconds",
        yscale="log",
        xticks=sorted(
            {int(c) for name in main for c in stacks[name]["common"]["ttft_by_priority"]}
        ),
    )
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    for ax in (ttft, cls):
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
    cdf.xaxis.set_major_formatter(plain)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"tandem simulate: Llama-3-8B on one H200; {document['traffic_template']}", fontsize=9
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals per run")
    p.add_argument("--common-rate", type=float, help="default: each group's baseline capacity")
    p.add_argument("--groups", default=",".join(GROUPS), help="comma list of " + ",".join(GROUPS))
    p.add_argument("--smoke", action="store_true", help="5 s of traffic, two rates, to /tmp")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "simulate_policies.json")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from --out's JSON")
    opts = p.parse_args()
    if opts.replot:
        plot(json.loads(opts.out.read_text()), opts.out.with_suffix(".png"))
        return
    if opts.smoke:
        opts.duration, opts.out = 5.0, Path("/tmp/simulate_policies_smoke.json")
    args = cli_args()
    started = time.perf_counter()
    stacks: dict[str, dict[str, Any]] = {}
    common_rates: dict[str, float] = {}
    for group in opts.groups.split(","):
        names, rates = GROUPS[group]
        grid = rates[3:5] if opts.smoke else rates
        configs, samples = {}, {}
        for name in names:
            path = STACK_DIR / f"{name}.yaml"
            configs[name] = stack_config(str(path), args)
            points, samples[name], capacity, failed = sweep(
                configs[name], args, name, grid, opts.duration
            )
            stacks[name] = {
                "stack_file": str(path.relative_to(REPO)),
                "group": group,
                "num_kv_blocks": configs[name].cache.num_kv_blocks,
                "capacity_rate": capacity,
                "first_failed": failed,
                "sweep": points,
            }
            print(f"{name:>20}: capacity {capacity} req/s (first failed: {failed})", flush=True)
        common = opts.common_rate or stacks[names[0]]["capacity_rate"] or grid[0]
        common_rates[group] = common
        for name in names:
            done = [point for point in stacks[name]["sweep"] if point["rate"] == common]
            if done:
                summary, ttft = done[0], samples[name][common]
            else:
                summary, ttft = run(configs[name], args, common, opts.duration)
                summary = {"rate": common, **summary}
                print(f"{name:>20} @ {common:5.1f}/s  {short(summary)}  (common)", flush=True)
            stacks[name]["common"] = {**summary, "ttft_samples_ms": sorted(ttft)}
    wall = time.perf_counter() - started
    flags = [f"--duration {opts.duration:g}"] if opts.duration != 90.0 else []
    flags += [f"--common-rate {opts.common_rate:g}"] if opts.common_rate else []
    flags += [f"--groups {opts.groups}"] if opts.groups != ",".join(GROUPS) else []
    document = {
        "command": " ".join(["python benchmarks/simulate_policies.py", *flags]),
        "model": MODEL,
        "device": DEVICE,
        "max_model_len": MAX_MODEL_LEN,
        "engine_time": ENGINE_TIME,
        "traffic_template": TRAFFIC.format(rate="R", duration=f"{opts.duration:g}"),
        "slo": {"ttft_ms": SLO.ttft_ms, "tpot_ms": SLO.tpot_ms, "min_attainment": MIN_ATTAINMENT},
        "common_rate": common_rates,
        "capacity_rate": {n: d["capacity_rate"] for n, d in stacks.items()},
        "stacks": stacks,
        "wall_s": wall,
        "load_average": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(document, indent=1))
    plot(document, opts.out.with_suffix(".png"))
    print(f"capacity (req/s; TTFT <= 2 s and TPOT <= 100 ms for >= 90% of requests): "
          f"{document['capacity_rate']}")  # fmt: skip
    print(f"wall {wall:.0f} s; wrote {opts.out} and {opts.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
