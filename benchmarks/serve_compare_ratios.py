"""Medians and ratios of benchmarks/serve_compare.py: per-rate medians over repeats, the
saturated entry, tandem/vllm ratios per rate and the issue's serving targets."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from tandem.bench_serve_report import rate_value

OFFLINE_REFERENCE = Path(__file__).resolve().parent / "results" / "default.json"


def median_tree(values: list[Any]) -> Any:
    """Field-wise medians of equally shaped JSON values (numbers: median of the non-null;
    dicts: per key; anything else: the first)."""
    if values and all(isinstance(v, dict) for v in values):
        return {k: median_tree([v.get(k) for v in values]) for k in values[0]}
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if numbers and len(numbers) == len([v for v in values if v is not None]):
        return statistics.median(numbers)
    return values[0] if values else None


def median_doc(name: str, runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A results document whose per-rate figures are the medians over the runs."""
    ok = [r for r in runs if "rates" in r]
    if not ok:
        return None
    rates = [median_tree([r["rates"][i] for r in ok]) for i in range(len(ok[0]["rates"]))]
    return {"label": name, "runs": len(ok), "rates": rates}


def saturated(doc: dict[str, Any]) -> dict[str, Any]:
    """The rate entry measuring capacity: the burst (`inf`) if swept, else the busiest."""
    for entry in doc["rates"]:
        if entry["request_rate"] == "inf":
            return entry
    return max(doc["rates"], key=lambda e: e["request_throughput"])


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is 0."""
    return a / b if a is not None and b else None


def compare(
    tandem: dict[str, Any], vllm: dict[str, Any], offline_ratio: float | None
) -> dict[str, Any]:
    """tandem/vllm ratios and the issue's targets for one tandem variant: request
    throughput at the saturated entry (`saturated`) at least vLLM's and at least
    `offline_ratio` (offline output throughput tandem/vllm); per swept rate, TTFT and TPOT
    p50/p99 and request throughput; TTFT p50 and TPOT p50 <= vLLM's at every unsaturated
    rate, a finite rate at most 0.8x the smaller of the two measured capacities (saturated
    request throughputs)."""
    sat_t, sat_v = saturated(tandem), saturated(vllm)
    capacity = min(sat_t["request_throughput"], sat_v["request_throughput"])
    per_rate, unsaturated = {}, []
    vllm_rates = {str(e["request_rate"]): e for e in vllm["rates"]}
    for entry in tandem["rates"]:
        key = str(entry["request_rate"])
        if key not in vllm_rates:
            continue
        other = vllm_rates[key]
        per_rate[key] = {
            f"{m}_{q}": ratio(entry[f"{m}_ms"][q], other[f"{m}_ms"][q])
            for m in ("ttft", "tpot")
            for q in ("p50", "p99")
        } | {"request_throughput": ratio(entry["request_throughput"], other["request_throughput"])}
        if not math.isinf(rate_value(entry["request_rate"])) and float(key) <= 0.8 * capacity:
            unsaturated.append(key)
    throughput = ratio(sat_t["request_throughput"], sat_v["request_throughput"])

    def at_most_vllm(metric: str) -> bool | None:
        ok = [per_rate[k][metric] is not None and per_rate[k][metric] <= 1.0 for k in unsaturated]
        return all(ok) if ok else None

    return {
        "saturated_request_throughput": throughput,
        "offline_output_throughput_ratio": offline_ratio,
        "per_rate": per_rate,
        "unsaturated_rates": unsaturated,
        "targets": {
            "saturated_throughput_ratio_at_least_offline_ratio": (
                None if throughput is None or offline_ratio is None else throughput >= offline_ratio
            ),
            "saturated_throughput_at_least_vllm": (
                None if throughput is None else throughput >= 1.0
            ),
            "ttft_p50_at_most_vllm_at_every_unsaturated_rate": at_most_vllm("ttft_p50"),
            "tpot_p50_at_most_vllm_at_every_unsaturated_rate": at_most_vllm("tpot_p50"),
        },
    }


def offline_ratio(offline: dict[str, Any], name: str) -> tuple[float | None, str]:
    """Offline output throughput of tandem variant `name` over vLLM's and where it comes from:
    this run's offline medians, else the tandem/vllm ratio in results/default.json."""
    value = ratio(offline.get(name, {}).get("median"), offline.get("vllm", {}).get("median"))
    if value is not None:
        return value, "this run, same requests"
    if OFFLINE_REFERENCE.exists():
        reference = json.loads(OFFLINE_REFERENCE.read_text()).get("ratios", {})
        if "tandem/vllm" in reference:
            return reference["tandem/vllm"], f"{OFFLINE_REFERENCE.name} (tandem bench)"
    return None, "none"
