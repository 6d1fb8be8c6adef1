"""`tandem simulate calibrate`: fit the simulated device's cost model to this device.

    tandem simulate calibrate [--config STACK.yaml] [--out fit.json] [--max-seconds 300]
        [--threads N] [--repeats 3] [--seed 0] [--traffic SPEC ...] [--quiet]
    tandem simulate calibrate --merge FIT.json FIT.json ... [--out fit.json] [--quiet]

Builds the real engine for the stack (default: the embedded model, `model: default`) with
synchronous scheduling, times its steps over a grid of batch shapes for at most
`--max-seconds` (`step_profile.GridProfiler`: prefill chunks, decode batches at several
contexts, mixed steps), takes the median per grid point, then replays each `--traffic`
(`trace_profile.replay_steps`: the traffic on the real clock, every step timed; its steps
grouped by (requests, tokens) into points that count their steps), and fits two
non-negative linear models (`plugins/cost_models/linear_fit.py`), each weighted to
minimise relative error, a grid point counting once and a traffic point as many times as
it has steps (`point_weight`):

- device seconds per step (the executor's execute + sample) over the step-shape features
  (`FIT_FEATURES`: the token count as a piecewise-linear curve): the `calibrated-cost`
  plugin's answer;
- the engine's own CPU seconds per step (the rest of the step's wall time) as
  `step_s + per_request_s x requests`: the simulation's modelled `EngineTime`.

Prints each grid point with the fit's prediction and the fit quality (r2, median
relative error), and writes the fit file (`--out`, default `fit.json`;
`plugins/cost_models/calibrated.py` documents it). Use it with
`plugins: [..., {name: calibrated-cost, options: {fit: fit.json}}]` in a stack given to
`tandem simulate`, and the printed `--engine-time`.

`--merge` loads no model: it refits the union of the points of fit files made by separate
calibrations of the same stack on the same device (`merge_fits`). On a shared machine one
process can run the same steps ~10% slower than another for its whole life (not address
randomisation, not CPU placement; `benchmarks/fidelity_processes.py` measures the spread),
so a fit from one process carries that process's luck; pooled calibrations average it out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore
from tandem.plugins.cost_models.calibrated import CalibrationFit, load_fit, save_fit
from tandem.plugins.cost_models.linear_fit import FIT_FEATURES, LinearFit, fit_nonnegative, select
from tandem.schema.config import EngineConfig
from tandem.simulate.step_profile import GridProfiler, StepSample
from tandem.simulate.trace_profile import replay_steps
from tandem.simulate.traffic import generate, parse_traffic
from tandem.stack_file import load_config

#: The label prefix of the points measured under traffic (`--traffic`); `traffic:K` is the
#: K-th spec's.
TRAFFIC_LABEL = "traffic:"
#: CPU flags worth recording with a fit (the kernels' code paths depend on them).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "asimd", "sve")


@dataclass(frozen=True, slots=True)
class GridPoint:
    """The median of one grid point's steps: `features` (mean over its steps, `FEATURES`
    order), `device_s`, `engine_s` and `wall_s` (medians, seconds), `steps` (count)."""

    label: str
    num_reqs: int
    num_tokens: int
    features: tuple[float, ...]
    device_s: float
    engine_s: float
    wall_s: float
    steps: int


def grid_points(samples: list[StepSample]) -> list[GridPoint]:
    """Group samples by (label, requests, tokens) and take medians, in first-seen order."""
    from tandem.plugins.cost_models.linear_fit import step_features

    groups: dict[tuple[str, int, int], list[StepSample]] = defaultdict(list)
    for s in samples:
        groups[(s.label, s.shape.num_reqs, s.shape.num_tokens)].append(s)
    points = []
    for (label, reqs, tokens), group in groups.items():
        rows = [step_features(s.shape) for s in group]
        features = tuple(statistics.fmean(col) for col in zip(*rows, strict=True))
        points.append(
            GridPoint(
                label,
                reqs,
                tokens,
                features,
                statistics.median(s.device_s for s in group),
                statistics.median(s.engine_s for s in group),
                statistics.median(s.wall_s for s in group),
                len(group),
            )
        )
    return points


def point_weight(point: GridPoint) -> float:
    """How many steps a point stands for in the fit: 1 for a grid point (the grid is a
    design, not a sample), its step count for a traffic point (`TRAFFIC_LABEL`), so the
    fit weighs the traffic's shapes as often as the traffic runs them."""
    return float(point.steps) if point.label.startswith(TRAFFIC_LABEL) else 1.0


def fit_points(points: list[GridPoint]) -> tuple[LinearFit, LinearFit]:
    """(device fit over `FIT_FEATURES`, engine fit over (1, requests)), each point weighted
    by `point_weight`. ValueError when fewer than two points were measured."""
    if len(points) < 2:
        raise ValueError(
            f"calibrate: only {len(points)} grid point(s) measured; give --max-seconds more"
        )
    counts = [point_weight(p) for p in points]
    device = fit_nonnegative(
        [select(p.features, FIT_FEATURES) for p in points],
        [max(p.device_s, 1e-9) for p in points],
        counts=counts,
    )
    engine = fit_nonnegative(
        [(1.0, float(p.num_reqs)) for p in points],
        [max(p.engine_s, 1e-6) for p in points],
        counts=counts,
    )
    return device, engine


def describe_device(config: EngineConfig) -> str:
    """The CPU's model name and relevant flags (or the accelerator's name), and threads."""
    model, flags = platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == platform.machine():
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    text = f"{model}; flags: {' '.join(f for f in CPU_FLAGS if f in flags) or '-'}"
    text += f"; {os.cpu_count()} CPUs; worker threads {config.parallel.worker_num_threads}"
    if str(config.model.device).startswith("cuda"):
        import torch

        text = f"{torch.cuda.get_device_name()}; host {text}"
    return text


def stack_summary(config: EngineConfig) -> dict[str, Any]:
    """What the fit depends on besides the device: plugins, limits, layout, executor."""
    return {
        "plugins": [spec.name for spec in config.resolved_stack or []],
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "max_model_len": config.max_model_len,
        "block_size": config.cache.block_size,
        "num_kv_blocks": config.cache.num_kv_blocks,
        "executor": config.parallel.executor,
        "worker_num_threads": config.parallel.worker_num_threads,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
        "model_device": str(config.model.device),
    }


def profile_config(path: str | None, threads: int | None) -> EngineConfig:
    """The stack at `path` (None: the embedded model's defaults), resolved with synchronous
    scheduling and `threads` worker threads when given."""
    overrides: dict[str, Any] = {"async_scheduling": False, "worker_num_threads": threads}
    if path is None:
        overrides["model"] = "default"
    return resolve_config(load_config(path, **overrides))


def calibrate(
    config: EngineConfig,
    max_seconds: float = 300.0,
    repeats: int = 3,
    seed: int = 0,
    log: Any = print,
    traffic: Sequence[str] = (),
) -> tuple[CalibrationFit, list[GridPoint]]:
    """Profile the real engine of `config` (resolved, synchronous) over the grid for at
    most `max_seconds` after it is built, then replay each `traffic` spec
    (`tandem.simulate.traffic.parse_traffic` syntax) in full, and fit; returns the fit and
    its points (grid points first, then each traffic's, labelled `traffic:K`)."""
    load_before = os.getloadavg()
    loads = [parse_traffic(spec) for spec in traffic]  # bad specs fail before the model loads
    engine = EngineCore(config, source="tandem simulate calibrate")
    start = time.monotonic()
    try:
        profiler = GridProfiler(engine, start + max_seconds, repeats, seed, log)
        samples = profiler.run()
        for k, load in enumerate(loads):
            requests = generate(load, config.max_model_len)
            samples += replay_steps(engine, requests, seed, f"{TRAFFIC_LABEL}{k}", log)
    finally:
        engine.shutdown()
    points = grid_points(samples)
    profile = {
        "max_seconds": max_seconds,
        "elapsed_s": time.monotonic() - start,
        "repeats": repeats,
        "seed": seed,
        "skipped": profiler.skipped,
        "traffic": list(traffic),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    origin = (describe_device(config), config.model.model, stack_summary(config))
    return fit_file(points, *origin, steps=len(samples), profile=profile), points


def fit_file(
    points: list[GridPoint],
    device: str,
    model: str,
    stack: dict[str, Any],
    steps: int,
    profile: Any,
) -> CalibrationFit:
    """The fit of `points` (`fit_points`) as a fit file's contents: the `device`, `model`
    and `stack` it was measured on, `steps` the steps timed, `profile` how (one
    calibration's settings, or a list of them for a merged fit)."""
    device_fit, engine_fit = fit_points(points)
    return CalibrationFit(
        features=FIT_FEATURES,
        coef=device_fit.coef,
        step_s=engine_fit.coef[0],
        per_request_s=engine_fit.coef[1],
        device=device,
        model=model,
        stack=stack,
        samples=device_fit.samples,
        r2=device_fit.r2,
        median_abs_rel_error=device_fit.median_abs_rel_error,
        extra={
            "engine_time": {
                "r2": engine_fit.r2,
                "median_abs_rel_error": engine_fit.median_abs_rel_error,
            },
            "steps": steps,
            "profile": profile,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "points": [asdict(p) for p in points],
        },
    )


def merge_fits(fits: Sequence[CalibrationFit]) -> tuple[CalibrationFit, list[GridPoint]]:
    """One fit over the union of the points of `fits` (calibrations of the same stack on
    the same device, each from its own process or time), and those points. Every point
    keeps its weight (`point_weight`): a grid point measured in three calibrations counts
    three times, once per measurement. ValueError naming `merge` when fewer than two fits
    are given, a fit has no points (files before points were recorded), or the fits differ
    in device, model or stack."""
    if len(fits) < 2:
        raise ValueError(f"merge: expected at least two fit files, got {len(fits)}")
    first = fits[0]
    points: list[GridPoint] = []
    for k, fit in enumerate(fits):
        for key in ("device", "model", "stack"):
            if getattr(fit, key) != getattr(first, key):
                raise ValueError(
                    f"merge: fit {k} was measured on another {key} than fit 0 "
                    f"({getattr(fit, key)!r} vs {getattr(first, key)!r}); merge only "
                    "calibrations of one stack on one device"
                )
        raw = fit.extra.get("points")
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"merge: fit {k} records no points to refit")
        try:
            points += [GridPoint(**(p | {"features": tuple(p["features"])})) for p in raw]
        except (TypeError, KeyError) as exc:
            raise ValueError(f"merge: fit {k} has a malformed point: {exc}") from exc
    steps = sum(int(fit.extra.get("steps", 0)) for fit in fits)
    profiles = [fit.extra.get("profile") for fit in fits]
    merged = fit_file(points, first.device, first.model, first.stack, steps, profiles)
    return merged, points


def print_report(fit: CalibrationFit, points: list[GridPoint], file: TextIO) -> None:
    """Each grid point, measured against the fit; per traffic, its steps' device seconds
    measured and fitted; then the coefficients and quality."""
    print(f"{'grid point':<24}{'reqs':>5}{'tokens':>7}{'device ms':>11}{'fit ms':>9}"
          f"{'err':>7}{'engine ms':>11}", file=file)  # fmt: skip
    traffic: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for p in points:
        values = select(p.features, fit.features)
        predicted = sum(c * f for c, f in zip(fit.coef, values, strict=True))
        if p.label.startswith(TRAFFIC_LABEL):
            traffic[p.label].append((p.steps * p.device_s, p.steps * predicted))
            continue
        err = (predicted - p.device_s) / p.device_s if p.device_s > 0 else 0.0
        print(
            f"{p.label[:23]:<24}{p.num_reqs:>5}{p.num_tokens:>7}{1000 * p.device_s:>11.2f}"
            f"{1000 * predicted:>9.2f}{100 * err:>6.1f}%{1000 * p.engine_s:>11.3f}",
            file=file,
        )
    for label, pairs in traffic.items():
        measured, predicted = (sum(column) for column in zip(*pairs, strict=True))
        print(
            f"{label}: {len(pairs)} points, device {measured:.2f} s measured, "
            f"{predicted:.2f} s fitted ({100 * (predicted / measured - 1):+.1f}%)",
            file=file,
        )
    terms = ", ".join(f"{n}={c:.4g}" for n, c in zip(fit.features, fit.coef, strict=True))
    engine = fit.extra.get("engine_time", {})
    print(f"device fit (s per unit): {terms}", file=file)
    print(
        f"device fit: r2 {fit.r2:.4f}, median |relative error| "
        f"{100 * fit.median_abs_rel_error:.1f}% over {fit.samples} points",
        file=file,
    )
    print(
        f"engine time: step_s={fit.step_s:.3g}, per_request_s={fit.per_request_s:.3g} "
        f"(r2 {engine.get('r2', float('nan')):.3f}, median |relative error| "
        f"{100 * engine.get('median_abs_rel_error', float('nan')):.1f}%)",
        file=file,
    )
    print(
        f"use: --engine-time modelled:step={fit.step_s:.6g},per_request={fit.per_request_s:.6g}",
        file=file,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem simulate calibrate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", help="stack YAML (default: the embedded model's defaults)")
    p.add_argument("--out", type=Path, default=Path("fit.json"), help="fit file to write")
    p.add_argument("--max-seconds", type=float, default=300.0, help="profiling time budget")
    p.add_argument("--threads", type=int, help="worker threads (default: the stack's)")
    p.add_argument("--repeats", type=int, default=3, help="steps timed per grid point")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument(
        "--traffic",
        action="append",
        default=[],
        metavar="SPEC",
        help="after the grid, replay this traffic (tandem simulate's --traffic syntax) on the "
        "real clock and fit its steps too, each counted once; repeatable",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="FIT",
        help="load no model: refit the union of these fit files' points (calibrations of one "
        "stack on one device, in separate processes) and write --out",
    )
    p.add_argument("--quiet", action="store_true", help="print only the fit quality")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.merge:
        if args.config or args.traffic:
            raise ValueError("--merge refits existing fit files: it takes no --config or --traffic")
        fit, points = merge_fits([load_fit(path) for path in args.merge])
        print_report(fit, [] if args.quiet else points, sys.stdout)
        save_fit(fit, args.out)
        print(f"wrote {args.out} (merged {len(args.merge)} fits, {len(points)} points)")
        return 0
    if args.max_seconds <= 0 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        raise ValueError("--max-seconds must be > 0, --repeats and --threads >= 1")
    config = profile_config(args.config, args.threads)
    log = (lambda _line: None) if args.quiet else (lambda line: print(line, file=sys.stderr))
    fit, points = calibrate(config, args.max_seconds, args.repeats, args.seed, log, args.traffic)
    print_report(fit, [] if args.quiet else points, sys.stdout)
    save_fit(fit, args.out)
    print(f"wrote {args.out}")
    return 0
