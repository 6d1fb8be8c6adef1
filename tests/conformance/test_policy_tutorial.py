"""docs/policy-plugin-tutorial.md stays true: its plugin (docs/policy-tutorial/) fails
`victim-starvation` without a bound (a very large `max_preemptions`), and its stack file
passes the checks that preempt, run as a whole stack."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.testing.conformance import run_stack_conformance

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "policy-tutorial"
PLUGIN = "most_kv_victim:MostKVVictim"


@pytest.fixture(autouse=True)
def tutorial_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TUTORIAL))


def test_the_tutorial_stack_passes_the_preempting_checks() -> None:
    report = run_stack_conformance(
        str(TUTORIAL / "stack.yaml"), checks=["victim-starvation", "preemption"]
    )
    assert report.passed, report.summary()


def test_without_a_bound_the_tutorial_rule_starves_the_long_request() -> None:
    report = run_stack_conformance(
        str(TUTORIAL / "stack.yaml"),
        {PLUGIN: {"max_preemptions": 10**6}},
        checks=["victim-starvation"],
    )
    assert not report.passed
    assert [r.mode for r in report.results if not r.passed] == ["sync", "async"]
    assert all("starvation bound" in str(r.error) for r in report.results)
