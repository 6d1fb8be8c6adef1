"""Re-predict committed fidelity runs under other weightings of the calibration fit, without
measuring again.

    python benchmarks/fidelity_refit.py [--weights count,time,time0.5]
        [--fit benchmarks/results/simulate_fidelity_fit.json]
        [--results benchmarks/results/simulate_fidelity.json]

`simulate_fidelity.py` measures for ~20 minutes; its fit file keeps every calibration point
(features, device seconds, steps) and its results file every measured median. This script
refits the device coefficients from those points (`linear_fit.fit_nonnegative`, the same
relative-error fit as `tandem simulate calibrate`) with each weighting, then runs the same
simulations as `simulate_fidelity.predict` (the `calibrated` device for sync, the `inline`
one for async, as its table reports them) and prints predicted / measured for TTFT p50/p90,
TPOT p50/p90 and request throughput per (mode, rate). Weightings of a traffic point (grid
points always count 1):
- `count`: its step count (what `calibrate.point_weight` does; reproduces the committed
  predictions exactly);
- `timeP`: its step count times (its device seconds / the median point's) ** P (`time` = P 1):
  a shape weighs by its share of the traffic's device time, so long steps (bursts, large
  batches) weigh more.
Writes benchmarks/results/fidelity_refit.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tandem.plugins.cost_models.calibrated import CalibrationFit, load_fit
from tandem.plugins.cost_models.linear_fit import fit_nonnegative, select
from tandem.simulate.calibrate import FIT_FEATURES, TRAFFIC_LABEL

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
import simulate_fidelity  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FIGURES = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90"))


def point_counts(points: list[dict[str, Any]], weighting: str) -> list[float]:
    """Each point's weight in the fit under `weighting` (see the module docstring)."""
    if weighting != "count" and not weighting.startswith("time"):
        raise ValueError(f"--weights: expected count or time[P], got {weighting!r}")
    power = float(weighting[4:] or 1) if weighting.startswith("time") else 0.0
    median = statistics.median(p["device_s"] for p in points)
    counts = []
    for p in points:
        if not p["label"].startswith(TRAFFIC_LABEL):
            counts.append(1.0)
            continue
        counts.append(float(p["steps"]) * (p["device_s"] / median) ** power)
    return counts


def refit(base: CalibrationFit, points: list[dict[str, Any]], weighting: str) -> CalibrationFit:
    """`base` with its device coefficients refitted under `weighting`."""
    device = fit_nonnegative(
        [select(p["features"], FIT_FEATURES) for p in points],
        [max(p["device_s"], 1e-9) for p in points],
        counts=point_counts(points, weighting),
    )
    return dataclasses.replace(base, features=FIT_FEATURES, coef=tuple(device.coef))


def ratios(predicted: dict[str, Any], measured: dict[str, Any]) -> list[float]:
    out = [predicted[k][p] / measured[k][p] for k, p in FIGURES]
    return out + [predicted["request_throughput"] / measured["request_throughput"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", default="count,time,time0.5")
    parser.add_argument("--fit", type=Path, default=RESULTS / "simulate_fidelity_fit.json")
    parser.add_argument("--results", type=Path, default=RESULTS / "simulate_fidelity.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "fidelity_refit.json")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    points = json.loads(args.fit.read_text())["points"]
    base = load_fit(args.fit)
    fits = {w: refit(base, points, w) for w in args.weights.split(",") if w}
    trace = argparse.Namespace(
        requests=results["requests"], prompt="16,128", output="16,64", seed=results["seed"]
    )
    scratch = Path(tempfile.mkdtemp(prefix="fidelity-refit-"))
    rows = []
    print("predicted / measured: TTFT p50 p90, TPOT p50 p90, request throughput")
    for row in results["results"]:
        async_ = row["mode"] == "async"
        real = simulate_fidelity.real_config(async_, results["threads"])
        traffic = simulate_fidelity.traffic_at(trace, row["rate"], real.max_model_len)
        seed = simulate_fidelity.prompt_seed(trace, row["rate"], results["rates"])
        entry: dict[str, Any] = {"mode": row["mode"], "rate": row["rate"], "ratios": {}}
        for weighting, fit in fits.items():
            predicted = simulate_fidelity.predict(real, fit, traffic, seed, async_, scratch)
            entry["ratios"][weighting] = ratios(predicted, row["measured"])
        rows.append(entry)
        print(
            f"{row['mode']:5} {row['rate']:5.3g}  "
            + "  ".join(
                f"{w}: " + " ".join(f"{v:.2f}" for v in r) for w, r in entry["ratios"].items()
            ),
            flush=True,
        )
    doc = {
        "fit": str(args.fit),
        "results": str(args.results),
        "coef": {w: list(f.coef) for w, f in fits.items()},
        "features": list(FIT_FEATURES),
        "figures": [f"{k}.{p}" for k, p in FIGURES] + ["request_throughput"],
        "rows": rows,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
