"""How well does `tandem simulate` predict the real engine? Predicted vs measured on this CPU.

    python benchmarks/simulate_fidelity.py [--fit FIT.json | --calibrations 3 --calibrate-seconds 90
        --calibrate-rates 1,inf]
        [--threads 1] [--requests 48] [--prompt 16,128] [--output 16,64] [--seed 0]
        [--rates auto | R1,R2,R3] [--modes sync,async] [--repeats 3] [--served-probe-requests 32]

The embedded SmolLM2 (`model: default`, its default stack), the same trace on both sides:
Poisson arrivals, prompt and output lengths uniform in the given ranges (one seed: the
same shapes at every rate; prompt ids drawn afresh per rate, or every run after the first
would find its prompts in the prefix cache), at three rates (`auto`: 0.5x, 0.8x and 1.5x
the saturation rate the first calibration's fit predicts for a burst, sync), under
synchronous and asynchronous scheduling.

- Fit: `--calibrations` runs of `tandem simulate calibrate --threads T --max-seconds S
  --traffic ...`, each in its own child process, merged (`calibrate --merge`: one fit over
  all their points) into benchmarks/results/simulate_fidelity_fit.json (or `--fit`). One
  process can run the same steps ~10% slower than another for its whole life
  (`fidelity_processes.py`), so one calibration carries its process's luck into the fit;
  pooling several averages it out. The first calibration runs before any measuring (it
  sets the rates); the others run between the measured rounds
  (`calibration_schedule`), so the fit and the measurements sample the same stretch of
  the machine's drift; every prediction uses the merged fit. The traffic each replays after its grid
  (`--calibrate-rates`, default 1 req/s and a burst) has the trace's length distributions
  but another seed (one per calibration), so no calibration step is a step of a measured
  run: a user calibrates with traffic like what they will simulate.
- Measured: `fidelity_replay.replay` (open loop through `AsyncLLM`, the engine core in its
  own process as `tandem serve` runs it; its docstring says why), `--repeats` rounds per
  mode, each round a fresh `AsyncLLM` (a new engine-core process, warmed up) running the
  rates in turn, the modes' rounds alternating (sync, async, sync, ...) so the machine's
  drift falls on both modes alike, with a speed probe (`fidelity_probe`) before and after
  each run. The measured figure is the median over the repeats, with its spread (min,
  max) beside it: the median spans as many engine processes as rounds, and near
  saturation queueing amplifies the machine's drift, so one run is not a figure to hold
  a prediction to.
- Predicted: `tandem.simulate.driver.simulate` on the same stack (the scripted model in the
  real model's place: same vocabulary, max_model_len, KV pool and limits) plus the
  `calibrated-cost` plugin with the fit, and the fit's `EngineTime`; the same traffic list.
  Four ways (`PREDICTIONS`): `calibrated` (the virtual device, as `tandem simulate` runs
  it), `inline` (the inline device: no engine/device overlap, as the `inprocess`
  executor on a CPU; the same as `calibrated` under sync scheduling),
  `inline_normalised` (inline, the device coefficients times the run's probe factor) and
  `served_normalised` (inline, the device coefficients times the run's served-probe
  factor: a `--served-probe-requests` burst with the trace's lengths sent through the
  measured `AsyncLLM` itself before and after each run, its makespan against the fit's
  simulation of the same burst; so it sees the served process's own speed, which the
  probe, another process, cannot). Neither probe uses the measured run's own timings.

Reported per (mode, rate): TTFT p50/p90, TPOT p50/p90, request and output throughput,
measured and predicted, and predicted / measured; and each figure's sensitivity to the
device's speed with the device-time factor that would close the gap
(`fidelity_sensitivity.py`). Writes
benchmarks/results/simulate_fidelity.json. The machine's load average is recorded: the
measured side shares the CPU with whatever else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_probe import SpeedProbe, scaled  # noqa: E402
from fidelity_replay import replay, warm_up  # noqa: E402

from tandem.config_resolution import default_stack, resolve_config  # noqa: E402
from tandem.engine.async_llm import AsyncLLM  # noqa: E402
from tandem.plugins.cost_models.calibrated import CalibrationFit, load_fit, save_fit  # noqa: E402
from tandem.schema.config import EngineConfig, PluginSpec  # noqa: E402
from tandem.simulate.driver import simulate  # noqa: E402
from tandem.simulate.inline_device import simulate_inline  # noqa: E402
from tandem.simulate.report import RequestTimeline, Slo, summarize  # noqa: E402
from tandem.simulate.traffic import TrafficRequest, generate, parse_traffic  # noqa: E402
from tandem.stack_file import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
MODES = {"sync": False, "async": True}
#: The calibration traffic's seed is the trace's plus this (`calibration_traffic`).
CALIBRATION_SEED_OFFSET = 7
#: Auto rates as multiples of the predicted saturation rate (the last one past it).
RATE_FACTORS = (0.5, 0.8, 1.5)
#: (summary key, percentile or None): the figures compared.
METRICS: tuple[tuple[str, str | None], ...] = (
    ("ttft_ms", "p50"),
    ("ttft_ms", "p90"),
    ("tpot_ms", "p50"),
    ("tpot_ms", "p90"),
    ("request_throughput", None),
    ("output_throughput", None),
)


def calibration_traffic(args: argparse.Namespace, calibration: int = 0) -> list[str]:
    """The traffic `calibrate --traffic` replays (`--calibrate-rates`): the trace's length
    distributions with another seed (other arrivals, lengths and prompts than any measured
    run; one per `calibration`) at rates that are not the measured ones."""
    rates = [r for r in args.calibrate_rates.split(",") if r]
    seed = args.seed + CALIBRATION_SEED_OFFSET + 100 * calibration
    other = argparse.Namespace(**vars(args) | {"seed": seed})
    return [traffic_spec(other, float(rate)) for rate in rates]


def calibrate_part(args: argparse.Namespace, k: int, scratch: Path) -> Path:
    """Calibration `k` (its own child process and traffic seed) into a file in `scratch`."""
    part = scratch / f"calibration-{k}.json"
    print(f"calibration {k + 1} of {args.calibrations}", flush=True)
    calibrate_fit(part, args.calibrate_seconds, args.threads, calibration_traffic(args, k))
    return part


def merge_parts(parts: list[Path], path: Path) -> CalibrationFit:
    """The calibrations merged into one fit at `path` (`calibrate --merge`: one fit over all
    their points; a single calibration is copied there)."""
    if len(parts) == 1:
        path.write_text(parts[0].read_text())
        return load_fit(path)
    command = [sys.executable, "-m", "tandem.cli", "simulate", "calibrate", "--quiet"]
    command += ["--out", str(path), "--merge", *map(str, parts)]
    subprocess.run(command, check=True)
    return load_fit(path)


def calibration_schedule(calibrations: int, repeats: int) -> dict[int, list[int]]:
    """Which calibrations run before which measured round: calibration j (j >= 1) before
    round round(j x repeats / calibrations), spreading them over the measurement (round
    `repeats` means after the last one). Calibration 0 runs first: it sets the rates."""
    schedule: dict[int, list[int]] = {}
    for j in range(1, calibrations):
        schedule.setdefault(min(repeats, round(j * repeats / calibrations)), []).append(j)
    return schedule


def calibrate_fit(
    path: Path, seconds: float, threads: int, traffic: list[str] | None = None
) -> CalibrationFit:
    """Run `tandem simulate calibrate` in a child process (its own model copy and memory),
    with `--traffic` for each spec in `traffic`."""
    command = [sys.executable, "-m", "tandem.cli", "simulate", "calibrate", "--out", str(path)]
    command += ["--threads", str(threads), "--max-seconds", str(seconds)]
    for spec in traffic or []:
        command += ["--traffic", spec]
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    subprocess.run(command, check=True, env=env)
    return load_fit(path)


def real_config(async_: bool, threads: int) -> EngineConfig:
    """The measured stack: the embedded model's defaults, the mode, the threads."""
    config = load_config(None, model="default", async_scheduling=async_)
    config.parallel.worker_num_threads = threads
    return resolve_config(config)


def sim_config(real: EngineConfig, fit_path: Path) -> EngineConfig:
    """The same stack on the simulated device: the scripted model with the real model's
    vocabulary, EOS, max_model_len, KV pool and limits, plus `calibrated-cost`."""
    config = load_config(
        None,
        model="scripted",
        vocab_size=real.model.vocab_size,
        eos_token_id=real.model.eos_token_id,
        max_model_len=real.max_model_len,
        max_num_seqs=real.scheduler.max_num_seqs,
        max_num_batched_tokens=real.scheduler.max_num_batched_tokens,
        async_scheduling=real.scheduler.async_scheduling,
        block_size=real.cache.block_size,
        num_kv_blocks=real.cache.num_kv_blocks,
        enable_prefix_caching=real.cache.enable_prefix_caching,
    )
    config.plugins = default_stack(config) + [
        PluginSpec(name="calibrated-cost", options={"fit": str(fit_path)})
    ]
    return config


def traffic_spec(args: argparse.Namespace, rate: float) -> str:
    return (
        f"poisson:rate={rate:.6g},n={args.requests},prompt=uniform({args.prompt}),"
        f"output=uniform({args.output}),seed={args.seed}"
    )


def prompt_seed(args: argparse.Namespace, rate: float, rates: list[float], repeat: int = 0) -> int:
    """The seed of a run's prompt ids: one per rate and repeat, so no run finds an earlier
    run's prompts in the engine's prefix cache (the simulation starts each run empty)."""
    return args.seed + 1000 * (1 + rates.index(rate)) + 100_000 * repeat


def traffic_at(args: argparse.Namespace, rate: float, max_model_len: int) -> list[TrafficRequest]:
    return generate(parse_traffic(traffic_spec(args, rate)), max_model_len)


def summary_of(timelines: list[RequestTimeline]) -> dict[str, Any]:
    ends = [t.finish_s for t in timelines if t.finish_s is not None]
    return summarize(timelines, duration_s=max(ends, default=0.0), slo=Slo())


PREDICTIONS = ("calibrated", "inline", "inline_normalised", "served_normalised")


class ModeRun(NamedTuple):
    """What one scheduling mode replays: its engine config, each rate's traffic, and the
    served probe's burst (`served_probe_traffic`)."""

    real: EngineConfig
    traffics: dict[float, list[TrafficRequest]]
    served_probe: list[TrafficRequest]


def served_probe_traffic(args: argparse.Namespace, max_model_len: int) -> list[TrafficRequest]:
    """The served probe's burst: `--served-probe-requests` requests at once, the trace's
    length distributions, a seed of its own (no measured or calibration run's shapes)."""
    other = {
        "requests": args.served_probe_requests,
        "seed": args.seed + CALIBRATION_SEED_OFFSET + 50,
    }
    return traffic_at(argparse.Namespace(**vars(args) | other), math.inf, max_model_len)


def makespan(timelines: list[RequestTimeline]) -> float:
    """Seconds from time 0 to the last request's finish."""
    return max((t.finish_s for t in timelines if t.finish_s is not None), default=0.0)


def predict(
    real: EngineConfig,
    fit: CalibrationFit,
    traffic: list[TrafficRequest],
    seed: int,
    inline: bool,
    scratch: Path,
) -> dict[str, Any]:
    """The simulation's summary of `traffic` with `fit` as the cost model, on the virtual
    device (`inline` False: what `tandem simulate` runs) or the inline one."""
    path = scratch / f"fit-{id(fit)}.json"
    save_fit(fit, path)
    run = simulate_inline if inline else simulate
    result = run(sim_config(real, path), traffic, engine_time=fit.engine_time(), seed=seed)
    return summary_of(result.timelines) | {
        "makespan_s": makespan(result.timelines),
        "device_busy_s": result.busy_s,
        "steps": result.num_steps,
    }


def saturation_rate(real: EngineConfig, fit: CalibrationFit, args: Any, scratch: Path) -> float:
    """Requests/s the calibrated simulation completes for the whole trace sent at once."""
    burst = traffic_at(args, math.inf, real.max_model_len)
    return predict(real, fit, burst, args.seed, True, scratch)["request_throughput"]


def measure(
    modes: dict[str, ModeRun],
    args: argparse.Namespace,
    probe: SpeedProbe,
    before_round: Callable[[int], None] = lambda _: None,
) -> dict[str, dict[float, list[dict[str, Any]]]]:
    """Replay each mode's traffic at each rate `args.repeats` times. One round is a fresh
    `AsyncLLM` of one mode (its own engine-core process, warmed up first) running every
    rate once; the modes' rounds alternate (sync #0, async #0, sync #1, ...) and the rates
    are interleaved within a round (r1, r2, r3), so a drift of the machine's speed spreads
    over both modes and every rate, and each (mode, rate) has its repeats in as many
    processes. The speed probe and the mode's served probe run before and after each run
    (`probe_factors`, `served_makespans_s`: [before, after]). Each repeat draws fresh
    prompt ids (`prompt_seed`), so no run finds an earlier run's prompts in the prefix
    cache. `before_round(r)` runs before round r of the modes and, with r = repeats, after
    the last (where `simulate_fidelity` runs its later calibrations)."""
    out = {mode: {rate: [] for rate in run.traffics} for mode, run in modes.items()}
    for repeat in range(args.repeats):
        before_round(repeat)
        for mode, run in modes.items():
            print(f"{mode}: round {repeat}", flush=True)
            llm = AsyncLLM(
                model="default", async_scheduling=MODES[mode], worker_num_threads=args.threads
            )
            try:
                asyncio.run(measure_round(llm, repeat, args, run, probe, out[mode]))
            finally:
                llm.shutdown()
    before_round(args.repeats)
    return out


async def measure_round(
    llm: AsyncLLM,
    repeat: int,
    args: argparse.Namespace,
    mode: ModeRun,
    probe: SpeedProbe,
    out: dict[float, list[dict[str, Any]]],
) -> None:
    """One round of `measure`: warm `llm` up, then each rate once, appended to `out`."""
    vocab = llm.config.model.vocab_size or 0
    traffics = mode.traffics
    rates = list(traffics)
    await warm_up(llm, vocab)
    probe_seeds = itertools.count(900_000 + 1000 * repeat)  # fresh prompt ids per probe

    async def served_makespan() -> float:
        run = await replay(llm, mode.served_probe, vocab, next(probe_seeds))
        return makespan(run.timelines)

    before, served_before = probe.factor(), await served_makespan()
    for rate, traffic in traffics.items():
        load = os.getloadavg()[0]
        seed = prompt_seed(args, rate, rates, repeat)
        run = await replay(llm, traffic, vocab, seed)
        after, served_after = probe.factor(), await served_makespan()
        summary = summary_of(run.timelines) | {
            "wall_s": run.wall_s,
            "max_send_lateness_s": run.max_send_lateness_s,
            "load_average_1m_before": load,
            "probe_factors": [before, after],
            "served_makespans_s": [served_before, served_after],
        }
        out[rate].append(summary)
        before, served_before = after, served_after
        print(f"  measured {rate:.3g} req/s #{repeat}: {brief(summary)}", flush=True)
        print(
            f"    probe factors {summary['probe_factors']}, served probe makespans "
            f"{summary['served_makespans_s']} s, load {load:.2f}",
            flush=True,
        )


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The compared metrics (`METRICS`) as medians over the repeats, and each one's
    spread over them (`spread`: [min, max]); `probe_factors` and `served_makespans_s`:
    every run's, in order."""
    out: dict[str, Any] = {"repeats": len(runs), "spread": {}}
    out |= {"probe_factors": [], "served_makespans_s": []}
    for key, pct in METRICS:
        values = [v for v in (metric(run, key, pct) for run in runs) if v is not None]
        value = statistics.median(values) if values else None
        if pct is None:
            out[key] = value
        else:
            out.setdefault(key, {})[pct] = value
        out["spread"][metric_name(key, pct)] = [min(values), max(values)] if values else None
    for run in runs:
        out["probe_factors"] += run["probe_factors"]
        out["served_makespans_s"] += run["served_makespans_s"]
    return out


def metric_name(key: str, pct: str | None) -> str:
    """A compared figure's name in the results (`ttft_ms.p50`, `request_throughput`)."""
    return f"{key}.{pct}" if pct else key


def metric(summary: dict[str, Any], key: str, pct: str | None) -> float | None:
    value = summary.get(key)
    if pct is not None:
        value = value.get(pct) if isinstance(value, dict) else None
    return float(value) if value is not None else None


def brief(summary: dict[str, Any]) -> str:
    parts = []
    for key, pct in METRICS:
        value = metric(summary, key, pct)
        parts.append(
            f"{key.removesuffix('_ms')}{'_' + pct if pct else ''}="
            + ("-" if value is None else f"{value:.3g}")
        )
    return " ".join(parts)


def ratios(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, pct in METRICS:
        p, m = metric(predicted, key, pct), metric(measured, key, pct)
        out[metric_name(key, pct)] = p / m if p is not None and m else None
    return out


def print_spread(rows: list[dict[str, Any]]) -> None:
    """Measured max / min over the repeats, per metric: the noise a prediction sits in."""
    heads = ["TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "req/s", "tok/s"]
    print("\nmeasured spread: max / min over the repeats")
    print(f"{'mode':<6}{'rate':>7}  " + "".join(f"{h:>10}" for h in heads))
    for row in rows:
        spans = row["measured"]["spread"].values()
        cells = "".join(
            f"{hi / lo:>10.3f}" if span and (lo := span[0]) and (hi := span[1]) else f"{'-':>10}"
            for span in spans
        )
        print(f"{row['mode']:<6}{row['rate']:>7.3g}  {cells}")


def print_table(rows: list[dict[str, Any]], prediction: str) -> None:
    heads = ["TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "req/s", "tok/s"]
    print(f"\n{prediction}: predicted / measured")
    print(f"{'mode':<6}{'rate':>7}  " + "".join(f"{h:>10}" for h in heads))
    for row in rows:
        values = row["ratio"][prediction].values()
        cells = "".join(f"{v:>10.3f}" if v is not None else f"{'-':>10}" for v in values)
        print(f"{row['mode']:<6}{row['rate']:>7.3g}  {cells}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fit", type=Path, help="an existing fit (default: calibrate first)")
    p.add_argument(
        "--calibrate-seconds", type=float, default=90.0, help="grid budget per calibration"
    )
    p.add_argument(
        "--calibrations",
        type=int,
        default=3,
        help="calibrations, each in its own process (the first before measuring, the others "
        "between the measured rounds), merged into one fit",
    )
    p.add_argument(
        "--calibrate-rates",
        default="1,inf",
        help="rates (req/s, inf: a burst) of the traffic calibrate replays after its grid, "
        "the trace's lengths with another seed; empty: the grid alone",
    )
    p.add_argument("--threads", type=int, default=1, help="worker threads, both sides")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt", default="16,128", help="uniform prompt length range")
    p.add_argument("--output", default="16,64", help="uniform output length range")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rates", default="auto", help="auto or a comma list of req/s")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per mode and rate")
    p.add_argument(
        "--served-probe-requests",
        type=int,
        default=32,
        help="requests in the served probe's burst (before and after each measured run)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "simulate_fidelity.json")
    args = p.parse_args()
    for flag in ("calibrations", "repeats", "served_probe_requests", "requests"):
        if getattr(args, flag) < 1:
            name = "--" + flag.replace("_", "-")
            p.error(f"{name}: expected at least 1, got {getattr(args, flag)}")
    return args


def mode_run(mode: str, args: argparse.Namespace, rates: list[float]) -> ModeRun:
    """The mode's config, its traffic at every rate, and its served probe's burst."""
    real = real_config(MODES[mode], args.threads)
    traffics = {rate: traffic_at(args, rate, real.max_model_len) for rate in rates}
    return ModeRun(real, traffics, served_probe_traffic(args, real.max_model_len))


def predict_mode(
    mode: str,
    run: ModeRun,
    runs: dict[float, list[dict[str, Any]]],
    args: argparse.Namespace,
    fit: CalibrationFit,
    scratch: Path,
) -> list[dict[str, Any]]:
    """Predict each of the mode's measured rates four ways (`PREDICTIONS`); one row per
    rate with the measured median, every measured run and the ratios."""
    rates = list(run.traffics)
    measured = {rate: median_of(runs[rate]) for rate in rates}
    served_s = predict(run.real, fit, run.served_probe, args.seed, True, scratch)["makespan_s"]
    rows = []
    for rate, traffic in run.traffics.items():
        factor = statistics.fmean(measured[rate]["probe_factors"])
        served_factor = statistics.fmean(m / served_s for m in measured[rate]["served_makespans_s"])
        fits = {"calibrated": (fit, False), "inline": (fit, True)}
        fits["inline_normalised"] = (scaled(fit, factor), True)
        fits["served_normalised"] = (scaled(fit, served_factor), True)
        seed = prompt_seed(args, rate, rates)
        predicted = {
            name: predict(run.real, f, traffic, seed, inline, scratch)
            for name, (f, inline) in fits.items()
        }
        for name in PREDICTIONS:
            print(f"  {mode} {name} {rate:.3g} req/s: {brief(predicted[name])}", flush=True)
        rows.append(
            {
                "mode": mode,
                "rate": rate,
                "traffic": traffic_spec(args, rate),
                "probe_factor": factor,
                "served_factor": served_factor,
                "measured": measured[rate],
                "measured_runs": runs[rate],
                "predicted": predicted,
                "ratio": {n: ratios(predicted[n], measured[rate]) for n in PREDICTIONS},
            }
        )
    return rows


def main() -> None:
    args = parse_args()
    started, load_before = time.monotonic(), os.getloadavg()
    fit_path = args.fit or RESULTS / "simulate_fidelity_fit.json"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        parts = [] if args.fit else [calibrate_part(args, 0, scratch)]
        first = load_fit(args.fit or parts[0])
        sync_config = real_config(False, args.threads)
        probe = SpeedProbe(sync_config)
        first_saturation = saturation_rate(sync_config, first, args, scratch)
        if args.rates == "auto":
            rates = [round(f * first_saturation, 3) for f in RATE_FACTORS]
        else:
            rates = [float(r) for r in args.rates.split(",")]
        print(f"predicted saturation {first_saturation:.3f} req/s; rates {rates}", flush=True)
        schedule = {} if args.fit else calibration_schedule(args.calibrations, args.repeats)

        def calibrate_before(round_: int) -> None:
            parts.extend(calibrate_part(args, k, scratch) for k in schedule.get(round_, []))

        modes = {m: mode_run(m, args, rates) for m in args.modes.split(",")}
        try:
            runs = measure(modes, args, probe, calibrate_before)
        finally:
            probe.close()
        fit = first if args.fit else merge_parts(parts, fit_path)
        saturation = saturation_rate(sync_config, fit, args, scratch)
        print(f"merged fit: predicted saturation {saturation:.3f} req/s", flush=True)
        for mode, run in modes.items():
            rows += predict_mode(mode, run, runs[mode], args, fit, scratch)
        from fidelity_sensitivity import annotate, print_sensitivity  # it imports this module

        annotate(rows, args, rates, fit, args.threads, scratch)
    print_spread(rows)
    for name in PREDICTIONS:
        print_table(rows, name)
    print_sensitivity(rows)
    shown = fit_path.relative_to(ROOT.parent) if fit_path.is_relative_to(ROOT.parent) else fit_path
    document = {
        "model": "default (embedded SmolLM2-135M-Instruct)",
        "device": fit.device,
        "threads": args.threads,
        "requests": args.requests,
        "prompt_uniform": args.prompt,
        "output_uniform": args.output,
        "seed": args.seed,
        "repeats": args.repeats,
        "served_probe_requests": args.served_probe_requests,
        "fit": {"path": str(shown)} | {k: v for k, v in fit.to_json().items() if k != "points"},
        "saturation_rate_predicted": saturation,
        "saturation_rate_first_calibration": first_saturation,
        "rates": rates,
        "predictions": {
            "calibrated": "tandem simulate as is: the virtual device, the fit as calibrated",
            "inline": "the inline device (no engine/device overlap: the inprocess executor)",
            "inline_normalised": (
                "inline, device coefficients x the run's probe factor (vs just after calibrating)"
            ),
            "served_normalised": (
                "inline, device coefficients x the run's served-probe factor (a burst through "
                "the measured engine: its makespan / the fit's)"
            ),
        },
        "results": rows,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_s": time.monotonic() - started,
    }
    args.out.write_text(json.dumps(document, indent=1, default=dataclasses.asdict) + "\n")
    print(f"wrote {args.out} in {document['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
