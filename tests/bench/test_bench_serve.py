"""`tandem bench serve` (and benchmarks/serve_compare.py) against a fake OpenAI-compatible
server on 127.0.0.1 (fake_openai_server.py: canned SSE streams; prompts `[500]`, `[666]`,
`[777]`, `[888]`, `[999]` make it fail, break, stall, omit usage or stream empty texts). The fake server runs under uvicorn
in a thread of this process, or as its own process for serve_compare. The tests check the
metrics' internal consistency (token counts, percentile order, goodput within throughput,
Poisson arrival counts), never wall-clock values; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fake_openai_server import fake_app

from tandem.bench_serve import (
    SweepConfig,
    arrival_offsets,
    main,
    run_sweep,
    stream_completion,
)
from tandem.bench_serve_report import percentile

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A running fake server: its base URL (`http://127.0.0.1:PORT/v1`) and the bodies it saw."""
    seen: list[dict[str, Any]] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(fake_app(seen), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(200):  # at most 10 s
            if server.started:
                break
            time.sleep(0.05)
        assert server.started, "fake server did not start"
        yield f"http://127.0.0.1:{port}/v1", seen
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _workload(tmp_path: Path, prompts: list[list[int]], max_tokens: list[int]) -> str:
    requests = [
        {"prompt_token_ids": p, "max_tokens": m} for p, m in zip(prompts, max_tokens, strict=True)
    ]
    path = tmp_path / "fake.json"
    path.write_text(json.dumps({"name": "fake", "requests": requests}))
    return str(path)


def _sweep(config: SweepConfig) -> dict[str, Any]:
    return asyncio.run(asyncio.wait_for(run_sweep(config), timeout=60))


def test_sweep_counts_every_token_and_orders_percentiles(fake_server, tmp_path) -> None:
    base_url, seen = fake_server
    max_tokens = [1, 2, 3, 5, 8, 4, 6, 7, 2, 3, 5, 1]
    prompts = [[100 + i] * (i + 2) for i in range(len(max_tokens))]
    workload = _workload(tmp_path, prompts, max_tokens)
    config = SweepConfig(
        base_url=base_url,
        workload=workload,
        request_rates=[200.0, math.inf],
        slo_ttft_ms=10_000,
        slo_tpot_ms=10_000,
        warmup=1,
    )
    before = len(seen)
    doc = _sweep(config)
    assert doc["model"] == "fake-model" and doc["num_requests"] == 12
    assert len(seen) - before == 1 + 2 * 12  # the warm-up, then every request at each rate
    body = seen[-1]
    assert body["ignore_eos"] is True and body["stream"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert isinstance(body["prompt"], list) and body["model"] == "fake-model"
    assert [r["request_rate"] for r in doc["rates"]] == [200.0, "inf"]
    for rate in doc["rates"]:
        assert rate["completed"] == 12 and rate["failed"] == 0 and rate["errors"] == []
        assert rate["total_output_tokens"] == sum(max_tokens)
        assert rate["total_prompt_tokens"] == sum(len(p) for p in prompts)
        assert rate["output_throughput"] == pytest.approx(sum(max_tokens) / rate["duration_s"])
        assert rate["request_throughput"] == pytest.approx(12 / rate["duration_s"])
        assert rate["goodput"] <= rate["request_throughput"] + 1e-9
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = rate[metric]
            assert 0 <= s["p50"] <= s["p90"] <= s["p99"], (metric, s)
        assert rate["ttft_ms"]["p50"] <= rate["e2e_ms"]["p50"]


@pytest.mark.parametrize("prompt", [[1, 2, 3], [999]], ids=["text", "token-only"])
def test_one_request_timings_add_up(fake_server, prompt) -> None:
    import httpx

    base_url, _ = fake_server
    payload = {
        "model": "fake-model",
        "prompt": prompt,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def go() -> Any:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            return await stream_completion(client, f"{base_url}/completions", payload)

    r = asyncio.run(go())
    assert r.ok and r.error is None and r.output_tokens == 6
    assert r.prompt_tokens == len(prompt)
    assert len(r.itl) == 5  # one gap between each pair of deltas, empty texts included
    assert 0 < r.ttft <= r.e2e
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 5)
    assert sum(r.itl) <= r.e2e - r.ttft + 1e-9


def test_failures_are_counted_with_their_reason(fake_server, tmp_path) -> None:
    base_url, _ = fake_server
    workload = _workload(tmp_path, [[1, 2], [500], [666], [3, 4]], [3, 3, 3, 3])
    doc = _sweep(SweepConfig(base_url, workload, [math.inf], warmup=0))
    (rate,) = doc["rates"]
    assert rate["completed"] == 2 and rate["failed"] == 2
    assert rate["total_output_tokens"] == 6
    assert any(e.startswith("HTTP 500") for e in rate["errors"])
    assert any("engine died" in e for e in rate["errors"])
    assert rate["goodput"] is None  # no SLO given


def test_request_timeout_and_run_deadline_bound_the_run(fake_server, tmp_path) -> None:
    base_url, _ = fake_server
    workload = _workload(tmp_path, [[777], [1]], [3, 3])
    config = SweepConfig(base_url, workload, [math.inf], warmup=0, request_timeout_s=0.5)
    (rate,) = _sweep(config)["rates"]
    assert rate["completed"] == 1 and rate["failed"] == 1
    assert any(e.startswith("timeout") for e in rate["errors"])
    config = SweepConfig(base_url, workload, [math.inf], warmup=0, deadline_s=0.5)
    (rate,) = _sweep(config)["rates"]
    assert rate["failed"] >= 1 and "cut off by the run deadline" in rate["errors"]


def test_missing_usage_falls_back_to_counting_chunks(fake_server, tmp_path) -> None:
    base_url, _ = fake_server
    workload = _workload(tmp_path, [[888], [888]], [4, 2])
    (rate,) = _sweep(SweepConfig(base_url, workload, [math.inf], warmup=0))["rates"]
    assert rate["completed"] == 2 and rate["usage_missing"] == 2
    assert rate["total_output_tokens"] == 6


def test_max_concurrency_and_num_requests_cycle_the_workload(fake_server, tmp_path) -> None:
    base_url, seen = fake_server
    workload = _workload(tmp_path, [[5], [6, 7]], [2, 3])
    before = len(seen)
    config = SweepConfig(base_url, workload, [math.inf], warmup=0, num_requests=5)
    config.max_concurrency = 2
    (rate,) = _sweep(config)["rates"]
    assert rate["completed"] == 5 and rate["total_output_tokens"] == 2 + 3 + 2 + 3 + 2
    assert sorted(len(b["prompt"]) for b in seen[before:]) == [1, 1, 1, 2, 2]


def test_poisson_arrivals_have_the_asked_rate() -> None:
    offsets = arrival_offsets(4000, 8.0, seed=3)
    assert len(offsets) == 4000 and offsets[0] == 0.0
    assert all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
    # 3999 exponential gaps of mean 1/8 s: the span is 500 s give or take 2% (5 sigma ~ 8%).
    assert offsets[-1] == pytest.approx(3999 / 8.0, rel=0.08)
    counts = [0] * 50  # arrivals per 10 s window: Poisson with mean 80
    for t in offsets:
        if t < 500:
            counts[int(t // 10)] += 1
    mean = sum(counts) / len(counts)
    var = sum((c - mean) ** 2 for c in counts) / (len(counts) - 1)
    assert mean == pytest.approx(80, rel=0.1) and var == pytest.approx(80, rel=0.6)
    assert arrival_offsets(10, 8.0, seed=3) == offsets[:10]
    assert arrival_offsets(10, 8.0, seed=4) != offsets[:10]
    assert arrival_offsets(5, math.inf, seed=0) == [0.0] * 5


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0


def test_cli_writes_json_png_and_plots_several_runs(fake_server, tmp_path) -> None:
    base_url, _ = fake_server
    workload = _workload(tmp_path, [[1, 2, 3], [4, 5]], [3, 2])
    outs = []
    for label in ("a", "b"):
        out = tmp_path / f"{label}.json"
        png = tmp_path / f"{label}.png"
        argv = ["--base-url", base_url, "--workload", workload, "--request-rates", "100,inf"]
        argv += ["--label", label, "--out", str(out), "--png", str(png), "--slo-ttft-ms", "1e5"]
        assert main(argv) == 0
        doc = json.loads(out.read_text())
        assert doc["label"] == label and len(doc["rates"]) == 2
        assert png.stat().st_size > 1000
        outs.append(str(out))
    combined = tmp_path / "both.png"
    assert main(["plot", *outs, "--png", str(combined)]) == 0
    assert combined.stat().st_size > 1000


def test_cli_reports_an_unreachable_server(tmp_path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    workload = _workload(tmp_path, [[1]], [2])
    argv = ["--base-url", f"http://127.0.0.1:{port}/v1", "--workload", workload]
    assert main([*argv, "--out", str(tmp_path / "x.json"), "--request-timeout", "5"]) == 1


def test_serve_compare_interleaves_servers_and_writes_ratios(tmp_path) -> None:
    fake = f"{sys.executable} {HERE / 'fake_openai_server.py'} --port {{port}}"
    workload = _workload(tmp_path, [[1, 2, 3], [4, 5]], [3, 4])
    out = tmp_path / "compare"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_compare.py"), "--no-offline"]
    cmd += ["--servers", "tandem-async,vllm", f"--server-cmd=tandem-async={fake}"]
    cmd += [f"--server-cmd=vllm={fake}", "--repeats", "2", "--request-rates", "100,inf"]
    cmd += ["--num-requests", "3", "--workload", workload, "--out", str(out), "--settle", "0"]
    cmd += ["--startup-timeout", "60", "--request-timeout", "30", "--sweep-deadline", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    order = [line.split(": ")[-1] for line in proc.stderr.splitlines() if ": repeat " in line]
    assert order == ["tandem-async", "vllm", "tandem-async", "vllm"]
    doc = json.loads(out.with_suffix(".json").read_text())
    for name in ("tandem-async", "vllm"):
        server = doc["servers"][name]
        assert len(server["runs"]) == 2 and all("rates" in run for run in server["runs"])
        assert [rate["completed"] for rate in server["median"]["rates"]] == [3, 3]
        assert server["median"]["rates"][1]["total_output_tokens"] == 3 + 4 + 3
    ratios = doc["ratios"]["tandem-async/vllm"]
    assert set(ratios["per_rate"]) == {"100.0", "inf"}
    assert ratios["saturated_request_throughput"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000


def _rate(rate: float | str, ttft: float, tpot: float, throughput: float) -> dict[str, Any]:
    quantiles = {"p50": 1.0, "p99": 1.0}
    return {
        "request_rate": rate,
        "ttft_ms": quantiles | {"p50": ttft},
        "tpot_ms": quantiles | {"p50": tpot},
        "request_throughput": throughput,
    }


def test_serve_compare_targets_cover_tpot_and_saturated_throughput() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_compare_ratios import compare

    vllm = {"rates": [_rate(0.5, 100.0, 50.0, 0.5), _rate("inf", 900.0, 90.0, 2.0)]}
    faster = {"rates": [_rate(0.5, 90.0, 45.0, 0.5), _rate("inf", 800.0, 80.0, 2.2)]}
    slower_tokens = {"rates": [_rate(0.5, 90.0, 55.0, 0.5), _rate("inf", 800.0, 80.0, 1.9)]}
    good = compare(faster, vllm, None)["targets"]
    assert good["ttft_p50_at_most_vllm_at_every_unsaturated_rate"] is True
    assert good["tpot_p50_at_most_vllm_at_every_unsaturated_rate"] is True
    assert good["saturated_throughput_at_least_vllm"] is True
    bad = compare(slower_tokens, vllm, None)["targets"]
    assert bad["ttft_p50_at_most_vllm_at_every_unsaturated_rate"] is True
    assert bad["tpot_p50_at_most_vllm_at_every_unsaturated_rate"] is False
    assert bad["saturated_throughput_at_least_vllm"] is False


def test_each_rate_sends_prompts_no_earlier_request_computed(fake_server, tmp_path) -> None:
    """Rate i rotates every prompt by i + 1 (same tokens, same length), so a prefix cache
    filled by the warm-up or an earlier rate serves nothing; the option turns it off."""
    base_url, seen = fake_server
    prompts = [[100 + 10 * i + j for j in range(5)] for i in range(3)]
    workload = _workload(tmp_path, prompts, [2, 2, 2])
    before = len(seen)
    _sweep(SweepConfig(base_url, workload, [math.inf, math.inf], warmup=1))
    bodies = seen[before:]
    assert bodies[0]["prompt"] == prompts[0]  # the warm-up, as written
    sent = [sorted(tuple(b["prompt"]) for b in bodies[1 + 3 * k : 4 + 3 * k]) for k in range(2)]
    for k, rate_prompts in enumerate(sent):
        expected = sorted(tuple(p[k + 1 :] + p[: k + 1]) for p in prompts)
        assert rate_prompts == expected
    first_tokens = [{p[0] for p in rate} for rate in sent] + [{p[0] for p in prompts}]
    assert not (first_tokens[0] & first_tokens[1]) and not (first_tokens[1] & first_tokens[2])
    before = len(seen)
    _sweep(SweepConfig(base_url, workload, [math.inf], warmup=0, fresh_prompts_per_rate=False))
    assert sorted(b["prompt"] for b in seen[before:]) == sorted(prompts)


def test_rotated_prompt_keeps_tokens_words_and_length() -> None:
    from tandem.bench_serve import rotated_prompt

    assert rotated_prompt([1, 2, 3, 4], 1) == [2, 3, 4, 1]
    assert rotated_prompt([1, 2, 3], 4) == [2, 3, 1]
    assert rotated_prompt("a b c", 2) == "c a b"
    assert rotated_prompt([], 3) == []
