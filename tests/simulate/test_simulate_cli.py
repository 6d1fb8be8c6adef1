"""`tandem simulate` end to end: stacks side by side, a rate sweep, JSON and PNG."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.cli import main

STACK = """
scheduler: {{max_num_seqs: 32, max_num_batched_tokens: 2048, async_scheduling: {async_}}}
cache: {{block_size: 16}}
"""


def write_stacks(tmp_path: Path) -> list[str]:
    paths = []
    for name, async_ in (("sync", "false"), ("async", "true")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(STACK.format(async_=async_))
        paths.append(str(path))
    return paths


def test_two_stacks_and_a_rate_sweep_write_json_and_png(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    sync, async_ = write_stacks(tmp_path)
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    argv = ["simulate", "--stack", sync, "--stack", async_, "--quiet"]
    argv += ["--traffic", "poisson:rate=5,n=60,prompt=uniform(64,512),output=uniform(8,64)"]
    argv += ["--rates", "2,8,1000", "--model", "llama-3-8b", "--device", "h100"]
    argv += ["--max-model-len", "1024", "--slo-ttft-ms", "200", "--slo-tpot-ms", "30"]
    argv += ["--out", str(out), "--plot", str(png)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc["stacks"]) == {"sync", "async"}
    for name in ("sync", "async"):
        summary = doc["stacks"][name]
        assert summary["completed"] == 60 and summary["failed"] == 0
        assert [p["rate"] for p in doc["sweeps"][name]] == [2.0, 8.0, 1000.0]
        assert 0 < summary["device_busy_fraction"] <= 1
        assert summary["usage"]["kv_cache_usage"]
    # A 1,000 req/s burst of 60 prompts misses a 200 ms TTFT on one H100: capacity is below it.
    assert all(rate is None or rate < 1000 for rate in doc["capacity_rate"].values())
    assert png.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "sync" in printed and "capacity" in printed


def test_bad_arguments_name_the_flag(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    sync, _ = write_stacks(tmp_path)
    assert main(["simulate", "--stack", sync, "--traffic", "poisson:rate=x,n=3"]) == 2
    assert "'rate'" in capsys.readouterr().err
    argv = [
        "simulate",
        "--stack",
        sync,
        "--traffic",
        "poisson:rate=1,n=3",
        "--engine-time",
        "guess",
    ]
    assert main(argv) == 2
    assert "engine_time.mode" in capsys.readouterr().err
    argv = ["simulate", "--stack", sync, "--traffic", "poisson:rate=1,n=3", "--device", "tpu"]
    assert main(argv) == 2
    assert "tpu" in capsys.readouterr().err


def test_tensor_parallelism_prices_steps_and_sizes_the_pool(tmp_path: Path) -> None:
    """`--tp` reaches the cost model (more ranks: faster decode) and the KV pool sizing
    (70B weights fit one H200 only when split)."""
    sync, _ = write_stacks(tmp_path)
    tpot = {}
    for tp in (2, 4):
        out = tmp_path / f"tp{tp}" / "sim.json"
        argv = ["simulate", "--stack", sync, "--quiet", "--model", "llama-3-70b"]
        argv += ["--device", "h200", "--tp", str(tp), "--out", str(out)]
        argv += ["--traffic", "poisson:rate=2,n=10,prompt=256,output=32"]
        assert main(argv) == 0
        tpot[tp] = json.loads(out.read_text())["stacks"]["sync"]["tpot_ms"]["p50"]
    assert tpot[4] < 0.75 * tpot[2]
    argv = ["simulate", "--stack", sync, "--quiet", "--model", "llama-3-70b"]
    argv += ["--device", "h200", "--traffic", "poisson:rate=2,n=10,prompt=256,output=32"]
    assert main(argv) == 2  # 141 GB of weights on one 141 GB device


def test_engine_time_takes_the_output_hop() -> None:
    """`--engine-time` reads `output=S` in both modes; the modelled defaults stay."""
    from tandem.core.worker.virtual_device import EngineTime
    from tandem.simulate.cli import parse_engine_time

    assert parse_engine_time("modelled:output=0.01") == EngineTime(
        "modelled", step_s=5e-4, per_request_s=2e-5, output_s=0.01
    )
    assert parse_engine_time("measured:scale=2,output=0.002") == EngineTime(
        "measured", scale=2.0, output_s=0.002
    )
    assert parse_engine_time("modelled").output_s == 0.0
