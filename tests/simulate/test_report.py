"""tandem.simulate.report: hand-built timelines with known answers (latencies, goodput, queueing,
time-weighted KV usage), downsampling, capacity from a rate sweep, the table and the PNG."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest

from tandem.simulate.report import (
    RequestTimeline,
    Slo,
    UsageSample,
    latency_samples,
    max_rate_under_slo,
    plot_comparison,
    print_table,
    summarize,
    usage_series,
)


def _timeline(
    rid: str,
    *,
    arrival: float = 0.0,
    first: float = 0.1,
    gap: float = 0.02,
    n: int = 6,
    scheduled: float | None = None,
    reason: str | None = "length",
    prompt: int = 10,
) -> RequestTimeline:
    """A request whose n tokens come at `first`, `first + gap`, ... and that finishes with its
    last token."""
    times = [first + i * gap for i in range(n)]
    return RequestTimeline(
        request_id=rid,
        arrival_s=arrival,
        prompt_tokens=prompt,
        scheduled_s=arrival if scheduled is None else scheduled,
        token_times_s=times,
        finish_s=times[-1] if times else first,
        finish_reason=reason,
    )


def _usage(t: float, kv: float, running: int = 1, waiting: int = 0) -> UsageSample:
    return UsageSample(
        time_s=t, kv_cache_usage=kv, num_running=running, num_waiting=waiting, device_busy=True
    )


def test_known_latencies_and_throughputs() -> None:
    timelines = [_timeline("a"), _timeline("b", arrival=1.0, first=1.1)]
    s = summarize(timelines, duration_s=2.0, slo=Slo())
    assert s["completed"] == 2 and s["failed"] == 0 and s["unfinished"] == 0
    assert s["ttft_ms"]["mean"] == pytest.approx(100.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(100.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(20.0)
    assert s["itl_ms"]["p90"] == pytest.approx(20.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(200.0)  # 0.1 + 5 * 0.02
    assert s["total_output_tokens"] == 12 and s["total_prompt_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(6.0)
    assert s["goodput"] is None and s["slo_attainment"] is None
    assert s["kv_cache_usage"] is None and s["max_running"] is None
    assert s["device_busy_fraction"] is None
    json.dumps(s)  # JSON-serialisable


def test_itl_keeps_zero_gaps_of_a_speculative_burst() -> None:
    t = _timeline("a")
    t.token_times_s = [0.1, 0.1, 0.1, 0.2]  # three tokens in one step, then one more
    t.finish_s = 0.2
    s = summarize([t], duration_s=1.0, slo=Slo())
    assert s["itl_ms"]["p50"] == pytest.approx(0.0)
    assert s["itl_ms"]["mean"] == pytest.approx(100.0 / 3)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0 / 3)


def test_errors_and_aborts_are_not_completed() -> None:
    timelines = [
        _timeline("ok", reason="stop"),
        _timeline("err", reason="error"),
        _timeline("ab", reason="abort"),
        RequestTimeline(request_id="open", arrival_s=0.5, prompt_tokens=3),
    ]
    s = summarize(timelines, duration_s=1.0, slo=Slo(ttft_ms=1e6))
    assert (s["completed"], s["failed"], s["unfinished"]) == (1, 2, 1)
    assert s["total_output_tokens"] == 6 and s["total_prompt_tokens"] == 10
    assert s["goodput"] == pytest.approx(1.0)
    assert s["slo_attainment"] == pytest.approx(1.0)
    assert len(latency_samples(timelines)["ttft_ms"]) == 1


def test_goodput_counts_only_requests_meeting_every_slo() -> None:
    timelines = [
        _timeline("fast"),  # TTFT 100, TPOT 20, E2E 200
        _timeline("slow_first", first=0.5),  # TTFT 500
        _timeline("slow_tokens", gap=0.05),  # TPOT 50
        _timeline("one_token", n=1),  # no TPOT: meets any TPOT SLO
    ]
    s = summarize(timelines, duration_s=2.0, slo=Slo(ttft_ms=200.0, tpot_ms=30.0))
    assert s["goodput"] == pytest.approx(2 / 2.0)  # fast, one_token
    assert s["slo_attainment"] == pytest.approx(0.5)
    e2e_only = summarize(timelines, duration_s=2.0, slo=Slo(e2e_ms=250.0))
    assert e2e_only["goodput"] == pytest.approx(2 / 2.0)  # fast (200), one_token (100)


def test_slo_attainment_is_zero_when_nothing_completed() -> None:
    s = summarize([_timeline("e", reason="error")], duration_s=1.0, slo=Slo(ttft_ms=1.0))
    assert s["completed"] == 0 and s["goodput"] == 0.0 and s["slo_attainment"] == 0.0
    assert s["ttft_ms"]["p50"] is None


def test_queueing_comes_from_scheduled_s() -> None:
    timelines = [
        _timeline("a", arrival=0.0, scheduled=0.03, first=0.1),
        _timeline("b", arrival=1.0, scheduled=1.07, first=1.1),
    ]
    s = summarize(timelines, duration_s=2.0, slo=Slo())
    assert s["queueing_ms"]["mean"] == pytest.approx(50.0)
    assert s["queueing_ms"]["p50"] == pytest.approx(50.0)
    assert sorted(latency_samples(timelines)["queueing_ms"]) == pytest.approx([30.0, 70.0])


def test_latency_samples_are_per_request_ms() -> None:
    samples = latency_samples([_timeline("a"), _timeline("b", first=0.3, n=1)])
    assert sorted(samples["ttft_ms"]) == pytest.approx([100.0, 300.0])
    assert samples["tpot_ms"] == pytest.approx([20.0])  # b has one token: no TPOT
    assert sorted(samples["e2e_ms"]) == pytest.approx([200.0, 300.0])
    assert set(samples) == {"ttft_ms", "tpot_ms", "e2e_ms", "queueing_ms"}


def test_kv_usage_is_time_weighted() -> None:
    # 0.2 for 3 s, then 0.8 until the run ends at 4 s: mean (0.6 + 0.8) / 4
    usage = [_usage(3.0, 0.8, running=4, waiting=2), _usage(0.0, 0.2, running=1, waiting=7)]
    s = summarize([], duration_s=4.0, slo=Slo(), usage=usage, device_busy_s=1.0)
    assert s["kv_cache_usage"]["mean"] == pytest.approx(0.35)
    assert s["kv_cache_usage"]["max"] == pytest.approx(0.8)
    assert s["kv_cache_usage"]["p90"] == pytest.approx(0.8)  # 0.8 holds the top quarter
    assert (s["max_running"], s["max_waiting"]) == (4, 7)
    assert s["device_busy_fraction"] == pytest.approx(0.25)
    assert s["completed"] == 0 and s["request_throughput"] == 0.0


def test_num_preemptions_takes_the_larger_count() -> None:
    t = _timeline("a")
    t.num_preemptions = 2
    timelines = [t, _timeline("b")]
    assert summarize(timelines, duration_s=1.0, slo=Slo())["num_preemptions"] == 2
    s = summarize(timelines, duration_s=1.0, slo=Slo(), num_preemptions=5)
    assert s["num_preemptions"] == 5 and s["preempted_requests"] == 1


@pytest.mark.parametrize(("n", "max_points"), [(10, 20), (101, 10), (100, 10), (57, 2), (9, 1)])
def test_usage_series_downsamples_and_keeps_the_last(n: int, max_points: int) -> None:
    usage = [_usage(float(i), i / n, running=i, waiting=n - i) for i in range(n)]
    series = usage_series(usage, max_points=max_points)
    assert set(series) == {"time_s", "kv_cache_usage", "num_running", "num_waiting"}
    times = series["time_s"]
    assert len(times) <= max_points
    assert len(times) >= min(n, max(1, max_points // 2))
    if len(times) > 2:  # every k-th sample from the first, then the last
        steps = {b - a for a, b in zip(times[:-2], times[1:-1], strict=True)}
        assert len(steps) == 1 and times[-1] - times[-2] <= steps.pop()
    assert times[-1] == float(n - 1)
    assert times == sorted(times)
    assert all(len(v) == len(times) for v in series.values())
    assert series["num_running"] == [int(t) for t in times]
    if n <= max_points:
        assert len(times) == n


def test_usage_series_rejects_zero_points() -> None:
    with pytest.raises(ValueError):
        usage_series([_usage(0.0, 0.1)], max_points=0)


def _sweep(*attainments: float | None) -> list[tuple[float, dict[str, Any]]]:
    return [(float(i + 1), {"slo_attainment": a}) for i, a in enumerate(attainments)]


def test_max_rate_under_slo() -> None:
    assert max_rate_under_slo(_sweep(1.0, 0.95, 0.9, 0.5)) == 3.0
    assert max_rate_under_slo(list(reversed(_sweep(1.0, 0.95, 0.5)))) == 2.0  # order-free
    assert max_rate_under_slo(_sweep(0.5, 1.0, 1.0)) is None  # the lowest fails
    assert max_rate_under_slo(_sweep(1.0, 0.2, 1.0, 1.0)) == 1.0  # stops at the first failure
    assert max_rate_under_slo(_sweep(1.0, None)) == 1.0
    assert max_rate_under_slo(_sweep(0.8, 0.8), min_attainment=0.75) == 2.0
    assert max_rate_under_slo([]) is None


def _results() -> dict[str, dict[str, Any]]:
    base = summarize(
        [_timeline("a"), _timeline("b", arrival=1.0, first=1.2)],
        duration_s=2.0,
        slo=Slo(ttft_ms=150.0),
        usage=[_usage(0.0, 0.1), _usage(1.0, 0.6), _usage(1.5, 0.3)],
        device_busy_s=1.5,
    )
    base["usage"] = usage_series([_usage(0.0, 0.1), _usage(1.0, 0.6), _usage(1.5, 0.3)])
    bare = summarize([_timeline("c", first=0.05)], duration_s=2.0, slo=Slo())
    return {"fcfs": base, "priority-stack": bare}


def test_print_table_one_row_per_stack_and_dashes() -> None:
    out = io.StringIO()
    results = _results()
    print_table(results, file=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 + len(results)
    assert lines[0].startswith("stack")
    assert lines[1].split()[0] == "fcfs" and lines[2].split()[0] == "priority-stack"
    fcfs, bare = lines[1].split(), lines[2].split()
    assert fcfs[1] == "2" and "75.0" in fcfs  # completed; device busy 1.5 / 2 s
    assert "0.50" in fcfs  # goodput: one of two requests within 150 ms over 2 s
    assert bare.count("-") == 2  # no goodput, no device busy figure
    assert "-" not in fcfs
    assert len({len(line) for line in lines[1:]}) == 1  # fixed width


def test_plot_comparison_writes_a_png(tmp_path: Path) -> None:
    results = _results()
    cdfs = {
        "fcfs": latency_samples([_timeline("a"), _timeline("b", first=0.2)]),
        "priority-stack": latency_samples([_timeline("c", first=0.05)]),
    }
    png = tmp_path / "plain" / "cmp.png"
    plot_comparison(results, png, cdfs=cdfs, title="two stacks")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 1000

    sweeps = {
        name: [
            (rate, {"goodput": 0.9 * rate, "request_throughput": rate, "slo_attainment": 0.9})
            for rate in (1.0, 2.0, 4.0)
        ]
        + [(math.inf, {"goodput": None, "request_throughput": 5.0})]
        for name in results
    }
    with_sweep = tmp_path / "sweep.png"
    plot_comparison(results, with_sweep, cdfs=cdfs, sweeps=sweeps)
    assert with_sweep.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert with_sweep.stat().st_size > 1000
