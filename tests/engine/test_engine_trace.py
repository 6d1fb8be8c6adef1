"""`tandem trace`: engine and device spans for sync and async, as Chrome trace + PNG."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.plugins.tracing import StepTracer
from tandem.trace import main as trace_main


def test_trace_writes_both_loops_with_engine_and_device_lanes(tmp_path: Path) -> None:
    out = tmp_path / "timeline"
    assert trace_main(["--out", str(out), "--requests", "8", "--prompt", "8", "--output", "4"]) == 0
    events = json.loads(out.with_suffix(".json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"sync step()", "async step_with_batch_queue()"}
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes == {"engine", "device", "hooks"}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["name"] for e in spans} >= {"schedule", "update", "wait"}
    # Per-plugin hook calls (trace_hooks) on their own lane, and their totals in the stats.
    assert "reference-scheduler.schedule" in {e["name"] for e in spans}
    assert all(e["dur"] >= 0 for e in spans)
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    stats = json.loads(out.with_suffix(".stats.json").read_text())
    assert stats["sync"]["steps"] > 0 and stats["async"]["steps"] > 0
    assert stats["async"]["hook_times"]["async-scheduler.update_after_schedule"]["calls"] > 0


def test_tracer_records_nested_spans_on_their_lanes() -> None:
    tracer = StepTracer()
    with tracer.span("engine", "schedule", step_id=3):
        pass
    events = tracer.to_chrome_trace("p")
    (span,) = [e for e in events if e["ph"] == "X"]
    assert span["name"] == "schedule" and span["args"]["step"] == 3 and span["ts"] == 0
