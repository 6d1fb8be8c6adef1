"""The plugin conformance suite on `diffusion-scheduler`, sync and async.

A diffusion scheduler runs on the scripted diffusion model with `diffusion-sampler`, its
outputs held to `expected_scripted_diffusion_output`; what does not apply to it is
reported "n/a" with the reason (a report line, and a pytest skip `-rs` prints), never
skipped silently.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tandem.testing.conformance import (
    CHECKS,
    MODES,
    NOT_APPLICABLE,
    run_conformance,
    scheduler_kind,
    stack_for,
)

#: Checks of `CHECKS` that do not apply to a diffusion scheduler.
NA_CHECKS = {"bounded-wait", "victim-starvation"}
#: Rules inside the checks that do not apply (replaced or dropped for diffusion).
NA_RULES = {"seeded-parity", "min-tokens"}


def test_kinds_pick_the_model_and_sampler() -> None:
    assert scheduler_kind("diffusion-scheduler") == "diffusion"
    assert scheduler_kind("reference-scheduler") == "autoregressive"
    assert stack_for("diffusion-scheduler")[1] == {"name": "diffusion-sampler"}
    assert stack_for("reference-scheduler")[1] == {"name": "default-sampler"}
    assert set(NOT_APPLICABLE["diffusion"]) == NA_CHECKS | NA_RULES
    assert not NOT_APPLICABLE["autoregressive"]


def test_suite_passes_on_diffusion_scheduler_with_explicit_not_applicable() -> None:
    report = run_conformance("diffusion-scheduler")
    summary = report.summary()
    assert report.passed, summary
    assert report.kind == "diffusion"
    ran = {(r.check, r.mode) for r in report.applied}
    assert ran == {(c, m) for c in CHECKS if c not in NA_CHECKS for m in MODES}, summary
    na = {(r.check, r.mode) for r in report.results if r.not_applicable is not None}
    assert na == {(c, m) for c in NA_CHECKS for m in MODES}
    assert set(report.not_applicable) == NA_CHECKS | NA_RULES
    for name in NA_CHECKS | NA_RULES:
        assert f"n/a: {NOT_APPLICABLE['diffusion'][name]}" in summary
    # Every run that applies did real work: steps, and preemption where it is the point.
    assert all(r.details["steps"] > 0 for r in report.applied)
    assert all(report.result("preemption", m).details["preemptions"] > 0 for m in MODES)
    assert all(report.result("abort", m).details["aborted"] > 0 for m in MODES)


def test_pytest_items_skip_not_applicable_with_the_reason(tmp_path: Path) -> None:
    """`pytest -p tandem --tandem-conformance diffusion-scheduler -rs`: the n/a checks and
    rules are skips whose reason starts with "n/a:" (only those items are selected)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    selected = "bounded or seeded or min or starvation"
    args = ["--tandem-conformance", "diffusion-scheduler", "-rs", "-k", selected]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tandem", "-p", "no:cacheprovider", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    # bounded-wait and victim-starvation x 2 modes, seeded-parity, min-tokens
    assert "6 skipped" in out, out
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert skips and all(": n/a: " in line for line in skips), out
    for name in NA_CHECKS | NA_RULES:
        assert NOT_APPLICABLE["diffusion"][name][:40] in out, name
