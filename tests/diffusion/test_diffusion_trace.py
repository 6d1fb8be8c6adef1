"""The trace timeline of a diffusion run: denoising steps (canvases per step) and commits
(request id, committed tokens) on their own lanes, in the tracer and the Chrome trace, and
`tandem trace --diffusion` writes them."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from tandem.plugins.tracing import StepTracer, enable_tracing
from tandem.testing import make_scripted_engine
from tandem.testing.engine import collect_outputs, make_request

PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [2, 6]]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_denoising_steps_and_commits_are_on_the_timeline(async_scheduling: bool) -> None:
    engine = make_scripted_engine(
        model="scripted-diffusion",
        max_model_len=64,
        num_kv_blocks=64,
        trace_hooks=True,
        async_scheduling=async_scheduling,
        diffusion={"canvas_length": 3},
    )
    tracer = StepTracer()
    enable_tracing(engine, tracer)
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(make_request(f"r{i}", prompt, max_tokens=7, ignore_eos=True))
        outputs = collect_outputs(engine, max_steps=300)
        stats = engine.stats()["diffusion"]
    finally:
        engine.shutdown()

    denoise = [s for s in tracer.spans if s.lane == "denoise"]
    commits = [s for s in tracer.spans if s.lane == "commit"]
    # Every denoising step of every request is in a `denoise` span, counted per step.
    assert sum(s.args["canvases"] for s in denoise) == stats["denoising_steps"]
    assert all(s.name == f"denoise {s.args['canvases']}" for s in denoise)
    assert all(s.args["canvas_positions"] <= 3 * s.args["canvases"] for s in denoise)
    assert all(s.start <= s.end for s in denoise)
    # Every commit: its request and token count; together they are the outputs.
    assert len(commits) == stats["commits"]
    committed: dict[str, int] = defaultdict(int)
    for s in commits:
        rid, tokens = s.args["request_id"], s.args["tokens"]
        assert s.name == f"commit {rid} +{tokens}" and 0 < tokens <= 3
        committed[rid] += tokens
    assert committed == {rid: len(tokens) for rid, (tokens, _) in outputs.items()}
    finals = [s for s in commits if s.args["finish_reason"] is not None]
    assert sorted(s.args["request_id"] for s in finals) == ["r0", "r1", "r2"]

    events = tracer.to_chrome_trace("diffusion")
    lanes = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"denoise", "commit", "engine"} <= lanes
    commit_events = [e for e in events if e["name"].startswith("commit ")]
    assert {e["args"]["request_id"] for e in commit_events} == {"r0", "r1", "r2"}


def test_an_autoregressive_run_has_no_diffusion_lanes() -> None:
    engine = make_scripted_engine(trace_hooks=True)
    tracer = StepTracer()
    enable_tracing(engine, tracer)
    try:
        engine.add_request(make_request("a", [3, 4, 5], max_tokens=4))
        collect_outputs(engine, max_steps=50)
    finally:
        engine.shutdown()
    assert {s.lane for s in tracer.spans} == {"engine", "hooks"}


def test_tandem_trace_diffusion_writes_the_lanes(tmp_path: Path) -> None:
    from tandem.trace import main

    out = tmp_path / "t"
    args = ["--diffusion", "--no-png", "--requests", "4", "--prompt", "6", "--output", "8"]
    assert main([*args, "--out", str(out)]) == 0
    events = json.loads(out.with_suffix(".json").read_text())["traceEvents"]
    for pid in (0, 1):  # sync and async
        names = [e["name"] for e in events if e.get("pid") == pid and e["ph"] == "X"]
        assert any(n.startswith("denoise ") for n in names)
        assert sum(n.startswith("commit ") for n in names) == 4 * 2  # 2 canvases of 4 each
    stats = json.loads(out.with_suffix(".stats.json").read_text())
    assert stats["sync"]["diffusion"]["committed_tokens"] == 4 * 8
