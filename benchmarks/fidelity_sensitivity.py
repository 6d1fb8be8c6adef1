"""How far does each figure of a fidelity run move with the device's speed?

    python benchmarks/fidelity_sensitivity.py [--results benchmarks/results/simulate_fidelity.json]
        [--fit FIT.json] [--step 0.05]

For each (mode, rate) row of a `simulate_fidelity.py` results file, simulates the row's
trace as its `inline` prediction does (the inline device; the same as `calibrated` under
sync scheduling) with the fit's device coefficients times (1 - step) and (1 + step), and
reports per figure (`simulate_fidelity.METRICS`):

- **elasticity**: d log(figure) / d log(device time), from those two runs. 1 means the
  figure scales with the device time as a fixed batch would; 3 means a device 1% slower
  makes it 3% larger, as queueing near saturation does; throughput reads 0 below
  saturation and about -1 past it.
- **implied device-time factor**: (measured / predicted) ** (1 / elasticity), the factor
  on the fit's device time that would close the row's gap were the figure log-linear in
  it; None where |elasticity| < `MIN_ELASTICITY` (the figure hardly depends on speed).

The elasticity is what turns the spread of engine processes' speeds on a machine
(`fidelity_processes.py`: 8-10% between processes on a shared 2-core VM) into the spread
a latency figure can have there: an elasticity of 2.5 makes a 4% speed difference a 10%
latency one. A row whose implied factors agree with each other and lie within that speed
spread is missed by the device speed fed in, not by how the simulation schedules and
batches. Writes the `sensitivity` entry of each row into the results file (in place) and
prints the table; `simulate_fidelity.py` fills the same entry as it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_probe import scaled  # noqa: E402
from simulate_fidelity import (  # noqa: E402
    METRICS,
    MODES,
    RESULTS,
    metric,
    metric_name,
    predict,
    prompt_seed,
    real_config,
    traffic_at,
)

from tandem.plugins.cost_models.calibrated import CalibrationFit, load_fit  # noqa: E402

#: Below this |elasticity| no implied factor is given (the figure barely moves with speed).
MIN_ELASTICITY = 0.25


def elasticities(low: dict[str, Any], high: dict[str, Any], step: float) -> dict[str, float | None]:
    """d log(figure) / d log(device time) per figure, from predictions with the device
    time times (1 - step) (`low`) and (1 + step) (`high`)."""
    span = math.log((1 + step) / (1 - step))
    out: dict[str, float | None] = {}
    for key, pct in METRICS:
        a, b = metric(low, key, pct), metric(high, key, pct)
        name = metric_name(key, pct)
        out[name] = math.log(b / a) / span if a and b else None
    return out


def implied_factors(
    ratio: dict[str, float | None], elasticity: dict[str, float | None]
) -> dict[str, float | None]:
    """Per figure, the device-time factor that would make predicted / measured 1:
    (1 / ratio) ** (1 / elasticity); None where the figure barely depends on speed."""
    out: dict[str, float | None] = {}
    for name, r in ratio.items():
        e = elasticity.get(name)
        ok = r is not None and r > 0 and e is not None and abs(e) >= MIN_ELASTICITY
        out[name] = (1 / r) ** (1 / e) if ok else None
    return out


def annotate(
    rows: list[dict[str, Any]],
    trace: argparse.Namespace,
    rates: list[float],
    fit: CalibrationFit,
    threads: int,
    scratch: Path,
    step: float = 0.05,
) -> None:
    """Set each row's `sensitivity`: `step`, `elasticity` and `implied_device_time_factor`
    (against the row's `inline` ratio). `trace` carries the trace's `requests`, `prompt`,
    `output` and `seed` as `simulate_fidelity.py` takes them."""
    for row in rows:
        real = real_config(MODES[row["mode"]], threads)
        traffic = traffic_at(trace, row["rate"], real.max_model_len)
        seed = prompt_seed(trace, row["rate"], rates)
        low, high = (
            predict(real, scaled(fit, f), traffic, seed, True, scratch)
            for f in (1 - step, 1 + step)
        )
        elasticity = elasticities(low, high, step)
        row["sensitivity"] = {
            "step": step,
            "elasticity": elasticity,
            "implied_device_time_factor": implied_factors(row["ratio"]["inline"], elasticity),
        }


def print_sensitivity(rows: list[dict[str, Any]]) -> None:
    heads = ["TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "req/s"]
    names = [metric_name(k, p) for k, p in METRICS][: len(heads)]
    for title, key in (
        ("elasticity: d log(figure) / d log(device time)", "elasticity"),
        ("implied device-time factor (inline prediction)", "implied_device_time_factor"),
    ):
        print(f"\n{title}")
        print(f"{'mode':<6}{'rate':>7}  " + "".join(f"{h:>10}" for h in heads))
        for row in rows:
            values = [row["sensitivity"][key][n] for n in names]
            cells = "".join(f"{v:>10.3f}" if v is not None else f"{'-':>10}" for v in values)
            print(f"{row['mode']:<6}{row['rate']:>7.3g}  {cells}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS / "simulate_fidelity.json")
    p.add_argument("--fit", type=Path, help="default: the fit the results file names")
    p.add_argument("--step", type=float, default=0.05, help="relative change of device time")
    args = p.parse_args()
    if not 0 < args.step < 1:
        p.error(f"--step: expected a number between 0 and 1, got {args.step}")
    document = json.loads(args.results.read_text())
    fit_path = args.fit or RESULTS.parent.parent / document["fit"]["path"]
    trace = argparse.Namespace(
        requests=document["requests"],
        prompt=document["prompt_uniform"],
        output=document["output_uniform"],
        seed=document["seed"],
    )
    with tempfile.TemporaryDirectory() as tmp:
        annotate(
            document["results"],
            trace,
            document["rates"],
            load_fit(fit_path),
            document["threads"],
            Path(tmp),
            args.step,
        )
    print_sensitivity(document["results"])
    args.results.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote the sensitivity of each row into {args.results}")


if __name__ == "__main__":
    main()
