"""The report of `tandem simulate`: per-request timelines in, one summary per stack out.

A stack's summary (`summarize`) is a JSON object: `completed`, `failed`, `unfinished`,
`duration_s`, `request_throughput` (completed requests/s), `output_throughput` (output tokens/s
of completed requests), `total_output_tokens`, `total_prompt_tokens`, `ttft_ms` / `tpot_ms` /
`itl_ms` / `e2e_ms` / `queueing_ms` (each `{mean, p50, p90, p99}` in ms, None without samples),
`goodput`, `slo_attainment`, `num_preemptions`, `preempted_requests`, `device_busy_fraction`,
`kv_cache_usage` (`{mean, max, p90}` as fractions in [0, 1], or None), `max_running` and
`max_waiting` (None without usage samples). All latency figures cover completed requests only.
Times are simulated seconds on the run's clock (0 = the run's start) unless a key says `_ms`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tandem.bench_serve_report import stats_ms

FAILED_REASONS = frozenset({"error", "abort"})
_MIN_DURATION_S = 1e-9


@dataclass(slots=True)
class RequestTimeline:
    """What the simulator records of one request, all times in simulated seconds from the run's
    start. `token_times_s` is non-decreasing, one entry per output token (several tokens may share
    a time under speculative decoding). A request is finished once `finish_s` is set; it completed
    when its `finish_reason` is not one of `FAILED_REASONS` ("error", "abort")."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    scheduled_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency service-level objectives in ms; a field left None is not checked. A request meets
    the SLO when every set field holds with `<=`."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def is_set(self) -> bool:
        """Whether any objective is given."""
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


@dataclass(slots=True)
class UsageSample:
    """The engine's state at one simulated time (s): KV-cache usage as a fraction in [0, 1], the
    running and waiting request counts, and whether the device is executing a step."""

    time_s: float
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    device_busy: bool


def is_completed(t: RequestTimeline) -> bool:
    """Finished, with a reason other than "error" or "abort"."""
    return t.finish_s is not None and t.finish_reason not in FAILED_REASONS


def _ttft_s(t: RequestTimeline) -> float | None:
    return t.token_times_s[0] - t.arrival_s if t.token_times_s else None


def _tpot_s(t: RequestTimeline) -> float | None:
    n = len(t.token_times_s)
    return (t.token_times_s[-1] - t.token_times_s[0]) / (n - 1) if n >= 2 else None


def _e2e_s(t: RequestTimeline) -> float | None:
    return t.finish_s - t.arrival_s if t.finish_s is not None else None


def _queueing_s(t: RequestTimeline) -> float | None:
    return t.scheduled_s - t.arrival_s if t.scheduled_s is not None else None


def _itl_s(t: RequestTimeline) -> list[float]:
    times = t.token_times_s
    return [b - a for a, b in zip(times[:-1], times[1:], strict=True)]


_PER_REQUEST = {
    "ttft_ms": _ttft_s,
    "tpot_ms": _tpot_s,
    "e2e_ms": _e2e_s,
    "queueing_ms": _queueing_s,
}


def _samples_s(completed: list[RequestTimeline]) -> dict[str, list[float]]:
    """Per-request latencies in seconds, keyed as `latency_samples`'s; requests without a value
    (no token, one token, never scheduled) are left out of that metric."""
    return {
        key: [v for t in completed if (v := metric(t)) is not None]
        for key, metric in _PER_REQUEST.items()
    }


def latency_samples(timelines: list[RequestTimeline]) -> dict[str, list[float]]:
    """Raw per-request samples in ms of the completed requests, for CDFs: `ttft_ms` (first token
    - arrival), `tpot_ms` ((last - first token) / (n - 1), requests with n >= 2 tokens),
    `e2e_ms` (finish - arrival) and `queueing_ms` (scheduled - arrival). Unsorted."""
    samples = _samples_s([t for t in timelines if is_completed(t)])
    return {key: [1000.0 * v for v in values] for key, values in samples.items()}


def meets_slo(t: RequestTimeline, slo: Slo) -> bool:
    """Whether a request meets every set objective. A request with one output token has no TPOT
    and meets any TPOT SLO; one without output tokens has no TTFT and misses any TTFT SLO."""
    if slo.ttft_ms is not None:
        ttft = _ttft_s(t)
        if ttft is None or 1000.0 * ttft > slo.ttft_ms:
            return False
    tpot = _tpot_s(t)
    if slo.tpot_ms is not None and tpot is not None and 1000.0 * tpot > slo.tpot_ms:
        return False
    e2e = _e2e_s(t)
    return slo.e2e_ms is None or (e2e is not None and 1000.0 * e2e <= slo.e2e_ms)


def _weighted_quantile(pairs: list[tuple[float, float]], q: float) -> float:
    """The smallest value whose cumulative weight reaches fraction `q` (0..1) of the total;
    `pairs` are (value, weight >= 0) with a positive total weight."""
    ordered = sorted(pairs)
    target = q * sum(w for _, w in ordered)
    acc = 0.0
    for value, weight in ordered:
        acc += weight
        if acc >= target and weight > 0:
            return value
    return ordered[-1][0]


def _kv_stats(usage: list[UsageSample], end_s: float) -> dict[str, float] | None:
    """`{mean, max, p90}` of KV-cache usage. Each sample holds until the next one and the last
    until `end_s` (on the samples' clock), which weights it; `max` is over samples. When every
    weight is zero (all samples at one time) the samples count equally."""
    if not usage:
        return None
    ordered = sorted(usage, key=lambda s: s.time_s)
    ends = [s.time_s for s in ordered[1:]] + [max(end_s, ordered[-1].time_s)]
    pairs = [(s.kv_cache_usage, end - s.time_s) for s, end in zip(ordered, ends, strict=True)]
    if sum(w for _, w in pairs) <= 0.0:
        pairs = [(v, 1.0) for v, _ in pairs]
    total = sum(w for _, w in pairs)
    return {
        "mean": sum(v * w for v, w in pairs) / total,
        "max": max(s.kv_cache_usage for s in ordered),
        "p90": _weighted_quantile(pairs, 0.9),
    }


def summarize(
    timelines: list[RequestTimeline],
    *,
    duration_s: float,
    slo: Slo,
    usage: list[UsageSample] | None = None,
    device_busy_s: float | None = None,
    num_preemptions: int = 0,
) -> dict[str, Any]:
    """One stack's summary (module docstring) over a run of `duration_s` simulated seconds.

    Rates divide by `duration_s` (floored at 1 ns). ITL pools every consecutive token gap of
    every completed request, zero gaps between tokens of one speculative burst included (so its
    low percentiles may read 0). `goodput` is completed requests/s meeting every set SLO field
    (`meets_slo`) and `slo_attainment` their fraction of the completed requests (0.0 when none
    completed); both are None when `slo` sets nothing. `num_preemptions` is the engine-wide count
    given, or the timelines' summed per-request counts when those are larger;
    `preempted_requests` counts timelines preempted at least once. `device_busy_fraction` is
    `device_busy_s / duration_s`, None without `device_busy_s`."""
    completed = [t for t in timelines if is_completed(t)]
    failed = [t for t in timelines if t.finish_s is not None and not is_completed(t)]
    duration = max(duration_s, _MIN_DURATION_S)
    samples = _samples_s(completed)
    output_tokens = sum(len(t.token_times_s) for t in completed)
    goodput: float | None = None
    attainment: float | None = None
    if slo.is_set():
        good = sum(meets_slo(t, slo) for t in completed)
        goodput = good / duration
        attainment = good / len(completed) if completed else 0.0
    usage = usage or []
    return {  # the keys and their order of the module docstring
        "completed": len(completed),
        "failed": len(failed),
        "unfinished": len(timelines) - len(completed) - len(failed),
        "duration_s": duration_s,
        "request_throughput": len(completed) / duration,
        "output_throughput": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": sum(t.prompt_tokens for t in completed),
        "ttft_ms": stats_ms(samples["ttft_ms"]),
        "tpot_ms": stats_ms(samples["tpot_ms"]),
        "itl_ms": stats_ms([gap for t in completed for gap in _itl_s(t)]),
        "e2e_ms": stats_ms(samples["e2e_ms"]),
        "queueing_ms": stats_ms(samples["queueing_ms"]),
        "goodput": goodput,
        "slo_attainment": attainment,
        "num_preemptions": max(num_preemptions, sum(t.num_preemptions for t in timelines)),
        "preempted_requests": sum(t.num_preemptions > 0 for t in timelines),
        "device_busy_fraction": None if device_busy_s is None else device_busy_s / duration,
        "kv_cache_usage": _kv_stats(usage, duration_s),
        "max_running": max((s.num_running for s in usage), default=None),
        "max_waiting": max((s.num_waiting for s in usage), default=None),
    }


def usage_series(usage: list[UsageSample], max_points: int = 2000) -> dict[str, list[float]]:
    """The usage samples as JSON-ready parallel lists `time_s`, `kv_cache_usage`, `num_running`
    and `num_waiting`, in time order. Beyond `max_points` (>= 1) samples it keeps every k-th
    (from the first) with the smallest k that fits, and always the last: never more than
    `max_points` points."""
    if max_points < 1:
        raise ValueError(f"max_points must be >= 1, got {max_points}")
    ordered = sorted(usage, key=lambda s: s.time_s)
    n = len(ordered)
    if n <= max_points:
        kept = ordered
    elif max_points == 1:
        kept = ordered[-1:]
    else:
        step = math.ceil((n - 1) / (max_points - 1))
        kept = ordered[::step]
        if (n - 1) % step:
            kept.append(ordered[-1])
    return {
        "time_s": [s.time_s for s in kept],
        "kv_cache_usage": [s.kv_cache_usage for s in kept],
        "num_running": [s.num_running for s in kept],
        "num_waiting": [s.num_waiting for s in kept],
    }


def max_rate_under_slo(
    points: list[tuple[float, dict[str, Any]]], min_attainment: float = 0.9
) -> float | None:
    """Capacity from a rate sweep of (offered rate in req/s, `summarize` result) pairs: the
    largest rate whose `slo_attainment` is >= `min_attainment` with every lower swept rate
    meeting it too (the sweep stops counting at the first failing rate). A missing or None
    attainment fails. None when the lowest rate fails or there are no points."""
    best: float | None = None
    for rate, summary in sorted(points, key=lambda p: p[0]):
        attainment = summary.get("slo_attainment")
        if attainment is None or attainment < min_attainment:
            break
        best = rate
    return best


def _get(summary: dict[str, Any], key: str, sub: str | None) -> Any:
    value = summary.get(key)
    return value if sub is None else (value.get(sub) if isinstance(value, dict) else None)


def _fmt(value: Any, digits: int = 1, scale: float = 1.0) -> str:
    return "-" if value is None else f"{scale * value:.{digits}f}"


_COLUMNS: tuple[tuple[str, str, str | None, int, float, int], ...] = (
    # header, summary key, sub-key, digits, scale, width
    ("ok", "completed", None, 0, 1.0, 6),
    ("req/s", "request_throughput", None, 2, 1.0, 8),
    ("tok/s", "output_throughput", None, 1, 1.0, 9),
    ("ttft50", "ttft_ms", "p50", 1, 1.0, 8),
    ("ttft90", "ttft_ms", "p90", 1, 1.0, 8),
    ("tpot50", "tpot_ms", "p50", 1, 1.0, 8),
    ("tpot90", "tpot_ms", "p90", 1, 1.0, 8),
    ("itl50", "itl_ms", "p50", 1, 1.0, 7),
    ("e2e50", "e2e_ms", "p50", 0, 1.0, 8),
    ("queue50", "queueing_ms", "p50", 1, 1.0, 8),
    ("goodput", "goodput", None, 2, 1.0, 8),
    ("preempt", "num_preemptions", None, 0, 1.0, 8),
    ("busy%", "device_busy_fraction", None, 1, 100.0, 6),
)


def print_table(results: dict[str, dict[str, Any]], file: TextIO | None = None) -> None:
    """A fixed-width table to `file` (stdout by default): a header line, then one row per stack
    in `results`' order. Latencies in ms, rates per second, `-` for a missing or None figure."""
    file = file or sys.stdout
    width = max([5, *(len(name) for name in results)])
    head = "".join(f"{h:>{w}}" for h, *_, w in _COLUMNS)
    print(f"{'stack':<{width}}{head}", file=file)
    for name, summary in results.items():
        cells = "".join(
            f"{_fmt(_get(summary, key, sub), digits, scale):>{w}}"
            for _, key, sub, digits, scale, w in _COLUMNS
        )
        print(f"{name:<{width}}{cells}", file=file)


def _plot_cdf(ax: Any, cdfs: dict[str, dict[str, list[float]]], names: list[str], key: str) -> None:
    """Empirical CDFs of one latency (ms) per stack; log-x when positive values span > 50x."""
    seen: list[float] = []
    for n, name in enumerate(names):
        values = sorted(cdfs.get(name, {}).get(key, []))
        if not values:
            continue
        seen += values
        ys = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
        ax.step([values[0], *values], ys, where="post", color=f"C{n}", label=name)
    if seen and min(seen) > 0 and max(seen) / min(seen) > 50:
        ax.set_xscale("log")
    ax.set_title(f"{key.removesuffix('_ms').upper()} CDF")
    ax.set_xlabel(f"{key.removesuffix('_ms').upper()} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)


def _plot_usage(ax: Any, results: dict[str, dict[str, Any]], names: list[str]) -> None:
    """KV-cache usage (%) over simulated time, from each stack's `usage` series if present."""
    for n, name in enumerate(names):
        series = results[name].get("usage")
        if series and series.get("time_s"):
            pct = [100.0 * u for u in series["kv_cache_usage"]]
            ax.step(series["time_s"], pct, where="post", color=f"C{n}", label=name, lw=1)
    ax.set_title("KV-cache usage")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV cache used (%)")
    ax.set_ylim(0, 102)


def _plot_sweep(ax: Any, sweeps: dict[str, list[tuple[float, Any]]], names: list[str]) -> None:
    """Goodput (solid) and request throughput (dashed) against offered rate per stack; infinite
    rates (bursts) and None figures are left out."""
    order = names + [s for s in sweeps if s not in names]
    for n, name in enumerate(order):
        points = sorted(
            ((r, s) for r, s in sweeps.get(name, []) if math.isfinite(r)), key=lambda p: p[0]
        )
        good = [(r, s["goodput"]) for r, s in points if s.get("goodput") is not None]
        tput = [(r, s["request_throughput"]) for r, s in points if "request_throughput" in s]
        if good:
            xs, ys = [r for r, _ in good], [v for _, v in good]
            ax.plot(xs, ys, "-o", color=f"C{n}", label=f"{name} goodput")
        if tput:
            xs, ys = [r for r, _ in tput], [v for _, v in tput]
            ax.plot(xs, ys, "--", color=f"C{n}", alpha=0.7, label=f"{name} throughput")
    ax.set_title("goodput vs offered rate")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("requests/s")


def plot_comparison(
    results: dict[str, dict[str, Any]],
    png: Path,
    *,
    cdfs: dict[str, dict[str, list[float]]],
    sweeps: dict[str, list[tuple[float, dict[str, Any]]]] | None = None,
    title: str = "",
) -> None:
    """One PNG comparing the stacks side by side, one colour per stack (`results`' order): TTFT,
    TPOT and E2E CDFs from `cdfs[stack]` (ms samples, as `latency_samples` gives), KV-cache usage
    over time from `results[stack]["usage"]` (a `usage_series`) and, with `sweeps` (stack ->
    [(offered rate, summary)]), goodput against offered rate. Creates `png`'s folder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, grid = plt.subplots(2, 3, figsize=(16, 9))
    axes = list(grid.flat)
    for ax, key in zip(axes[:3], ("ttft_ms", "tpot_ms", "e2e_ms"), strict=True):
        _plot_cdf(ax, cdfs, names, key)
    _plot_usage(axes[3], results, names)
    if sweeps:
        _plot_sweep(axes[4], sweeps, names)
        unused = axes[5:]
    else:
        unused = axes[4:]
    for ax in unused:
        ax.axis("off")
    for ax in axes[: len(axes) - len(unused)]:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(title or "tandem simulate")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
