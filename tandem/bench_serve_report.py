"""Figures and plots of `tandem bench serve`: per-rate summaries, the text table, the PNG.

A rate's summary (`summarize_rate`) is a JSON object: `request_rate` (a number, or the string
`"inf"` for a burst: JSON has no infinity), `completed`, `failed`, `errors` (the first few
reasons), `duration_s`, `request_throughput` (completed requests/s), `output_throughput`
(output tokens/s), `total_output_tokens`, `total_prompt_tokens`, `ttft_ms` / `tpot_ms` /
`itl_ms` / `e2e_ms` (each `{mean, p50, p90, p99}`, None without samples) and `goodput`
(completed requests/s that met every SLO given; None when no SLO is given).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default method); `values` must not be empty."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def stats_ms(seconds: list[float]) -> dict[str, float | None]:
    """Mean and percentiles of durations given in seconds, in milliseconds."""
    if not seconds:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = [1000.0 * s for s in seconds]
    return {"mean": sum(ms) / len(ms), **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


def rate_key(rate: float) -> float | str:
    """A request rate as JSON can hold it: `inf` becomes the string "inf"."""
    return "inf" if math.isinf(rate) else rate


def rate_value(key: float | str) -> float:
    """The inverse of `rate_key`."""
    return float(key)


def _meets_slo(result: Any, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and 1000.0 * result.ttft > slo_ttft_ms:
        return False
    tpot = result.tpot
    return slo_tpot_ms is None or tpot is None or 1000.0 * tpot <= slo_tpot_ms


def summarize_rate(
    rate: float,
    results: list[Any],
    duration: float,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
) -> dict[str, Any]:
    """One rate's summary (module docstring) from its `RequestResult`s and duration (s). A
    request with one output token has no TPOT and meets any TPOT SLO."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    duration = max(duration, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    good = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(_meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok) / duration
    return {
        "request_rate": rate_key(rate),
        "completed": len(ok),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:5],
        "usage_missing": sum(r.usage_missing for r in ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "ttft_ms": stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in ok if r.e2e is not None]),
        "goodput": good,
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_summary(results: dict[str, Any], file: Any = None) -> None:
    """A table of one results document, one line per rate."""
    file = file or sys.stdout
    print(
        f"{results.get('label')}: {results.get('workload')} workload, "
        f"{results.get('num_requests')} requests per rate",
        file=file,
    )
    head = "rate     ok fail  req/s  tok/s  ttft50  ttft99  tpot50  tpot99  itl50  e2e50 goodput"
    print(head, file=file)
    for r in results["rates"]:
        t, p, i, e = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2e_ms"]
        print(
            f"{str(r['request_rate']):6} {r['completed']:4} {r['failed']:4} "
            f"{r['request_throughput']:6.2f} {r['output_throughput']:6.1f} "
            f"{_fmt(t['p50']):>7} {_fmt(t['p99']):>7} {_fmt(p['p50']):>7} {_fmt(p['p99']):>7} "
            f"{_fmt(i['p50']):>6} {_fmt(e['p50'], 0):>6} {_fmt(r['goodput'], 2):>7}",
            file=file,
        )


def _axis_rates(documents: list[dict[str, Any]]) -> list[float]:
    rates = {rate_value(r["request_rate"]) for doc in documents for r in doc["rates"]}
    return sorted(rates)  # inf sorts last


def plot_results(documents: list[dict[str, Any]], png: Path, title: str = "") -> None:
    """TTFT and TPOT p50 (solid) and p99 (dashed), and request throughput, against request
    rate: one colour per document (its `label`). Rates are evenly spaced categories with
    `inf` last; latency axes turn logarithmic when values span more than 50x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis = _axis_rates(documents)
    ticks = [("inf" if math.isinf(r) else f"{r:g}") for r in axis]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"))
    for ax, (metric, name) in zip(axes, panels, strict=False):
        seen: list[float] = []
        for n, doc in enumerate(documents):
            by_rate = {rate_value(r["request_rate"]): r[metric] for r in doc["rates"]}
            xs = [i for i, rate in enumerate(axis) if rate in by_rate]
            for q, style in (("p50", "-o"), ("p99", "--s")):
                ys = [by_rate[axis[i]][q] for i in xs]
                points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
                seen += [y for _, y in points]
                ax.plot(
                    [x for x, _ in points],
                    [y for _, y in points],
                    style,
                    color=f"C{n}",
                    label=f"{doc.get('label')} {q}",
                )
        if seen and min(seen) > 0 and max(seen) / min(seen) > 50:
            ax.set_yscale("log")
        ax.set_title(name)
        ax.set_ylabel(name)
    for n, doc in enumerate(documents):
        by_rate = {rate_value(r["request_rate"]): r["request_throughput"] for r in doc["rates"]}
        xs = [i for i, rate in enumerate(axis) if rate in by_rate]
        ys = [by_rate[axis[i]] for i in xs]
        axes[2].plot(xs, ys, "-o", color=f"C{n}", label=str(doc.get("label")))
    axes[2].set_title("request throughput (req/s)")
    axes[2].set_ylabel("completed requests/s")
    for ax in axes:
        ax.set_xticks(range(len(axis)), ticks)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "tandem bench serve")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def documents_of(path: Path) -> list[dict[str, Any]]:
    """The result documents in a file: a `tandem bench serve` JSON is one; a
    benchmarks/serve_compare.py JSON holds one median document per server that ran."""
    data = json.loads(path.read_text())
    if "rates" in data:
        return [data]
    servers = data.get("servers", {})
    return [s["median"] for s in servers.values() if s.get("median")]


def plot_main(argv: list[str]) -> int:
    """`tandem bench serve plot A.json [B.json ...] --png OUT.png`."""
    parser = argparse.ArgumentParser(prog="tandem bench serve plot")
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files")
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    documents = [doc for path in args.results for doc in documents_of(path)]
    if not documents:
        print("tandem bench serve plot: no results in those files", file=sys.stderr)
        return 1
    plot_results(documents, args.png, title=args.title)
    print(f"tandem bench serve plot: wrote {args.png.resolve()}", file=sys.stderr)
    return 0
