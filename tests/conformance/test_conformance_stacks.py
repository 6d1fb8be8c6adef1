"""The conformance kit for stacks: per-plugin options (`NAME=JSON`, the bare JSON object only
when it cannot be ambiguous), a whole stack file as the unit under test, and the
`victim-starvation` check, which fails a victim rule with no starvation bound and says why."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin
from tandem.core.request import Request
from tandem.testing.conformance import (
    PREEMPTION_BOUND,
    ConformanceError,
    RequestSpec,
    Workload,
    check_conformance,
    load_stack,
    run_stack_conformance,
    run_workload,
)
from tandem.testing.pytest_plugin import _conformance_options

STACK = """
model: {model: scripted}
scheduler: {async_scheduling: true}
plugins:
  - reference-scheduler
  - name: srpt-order
    options: {aging_rate: 16.0}
  - name: lrw-victim
    options: {max_preemptions: 2}
  - default-sampler
"""


class _Config:
    def __init__(self, options: list[str], names: list[str], stacks: Sequence[str] = ()) -> None:
        self.values = {
            "tandem_conformance_options": options,
            "tandem_conformance": names,
            "tandem_conformance_stack": list(stacks),
        }

    def getoption(self, name: str) -> list[str]:
        return self.values[name]


class LongestRemainingWorkUnbounded(TandemPlugin):
    """Always the running request with the most work left: no starvation bound."""

    @hookimpl
    def select_preemption_victim(self, running: Sequence[Request], needed_by: Request) -> Request:
        def left(r: Request) -> int:
            return r.max_tokens - r.num_output_tokens + r.num_prompt_tokens

        return max(reversed(running), key=left)


@pytest.fixture
def stack_file(tmp_path: Path) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(STACK)
    return path


# Per-plugin options ------------------------------------------------------------------------
def test_each_plugin_gets_its_own_options() -> None:
    config = _Config(
        ['srpt-order={"aging_rate": 8.0}', 'lrw-victim={"max_preemptions": 3}'],
        ["srpt-order", "lrw-victim"],
    )
    assert _conformance_options(config) == {  # type: ignore[arg-type]
        "srpt-order": {"aging_rate": 8.0},
        "lrw-victim": {"max_preemptions": 3},
    }


def test_a_bare_json_object_with_two_plugins_is_ambiguous() -> None:
    config = _Config(['{"aging_rate": 8.0}'], ["srpt-order", "lrw-victim"])
    with pytest.raises(pytest.UsageError, match="ambiguous.*NAME=JSON"):
        _conformance_options(config)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ('lrw-victm={"max_preemptions": 3}', r"no plugin 'lrw-victm' is under test"),
        ("srpt-order", r"expected NAME=JSON"),
    ],
)
def test_options_for_a_plugin_not_under_test_are_refused(raw: str, message: str) -> None:
    config = _Config([raw], ["srpt-order", "lrw-victim"])
    with pytest.raises(pytest.UsageError, match=message):
        _conformance_options(config)  # type: ignore[arg-type]


def test_options_given_twice_are_refused() -> None:
    config = _Config(["srpt-order={}", "srpt-order={}"], ["srpt-order"])
    with pytest.raises(pytest.UsageError, match="given twice"):
        _conformance_options(config)  # type: ignore[arg-type]


# Starvation --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_victim_rule_without_a_bound_fails_victim_starvation_saying_why(mode: str) -> None:
    with pytest.raises(ConformanceError) as info:
        check_conformance(LongestRemainingWorkUnbounded, "victim-starvation", mode)  # type: ignore[arg-type]
    message = str(info.value)
    assert f"no request is preempted more than {PREEMPTION_BOUND} times" in message
    assert "keeps choosing it" in message and "needs a starvation bound" in message
    assert "-long" in message  # the long request is the one it starves


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_bounded_victim_rule_passes_victim_starvation(mode: str) -> None:
    details = check_conformance("lrw-victim", "victim-starvation", mode, {"max_preemptions": 2})  # type: ignore[arg-type]
    assert details["preemptions"] > 0


def test_a_request_past_its_finish_bound_fails() -> None:
    workload = Workload(
        "late-finish",
        (RequestSpec("slow", (2, 3, 5), max_tokens=12, ignore_eos=True, finish_by=4),),
        {
            "max_model_len": 64,
            "block_size": 4,
            "num_kv_blocks": 16,
            "max_num_batched_tokens": 16,
            "max_num_seqs": 2,
        },
    )
    with pytest.raises(ConformanceError, match="finishes within its bound") as info:
        run_workload("reference-scheduler", workload)
    assert "has not finished after step 4" in str(info.value)


# A whole stack -----------------------------------------------------------------------------
def test_a_stack_file_is_the_unit_under_test(stack_file: Path) -> None:
    stack = load_stack(stack_file, {"lrw-victim": {"max_preemptions": 3}})
    assert stack.names() == ["reference-scheduler", "srpt-order", "lrw-victim", "default-sampler"]
    assert dict(stack.entries)["lrw-victim"] == {"max_preemptions": 3}
    assert dict(stack.entries)["srpt-order"] == {"aging_rate": 16.0}
    report = run_stack_conformance(str(stack_file), checks=["victim-starvation", "preemption"])
    assert report.passed, report.summary()
    assert report.plugin == f"stack {stack_file}"


def test_stack_options_reach_the_stack_entry(stack_file: Path) -> None:
    report = run_stack_conformance(
        str(stack_file), {"lrw-victim": {"max_preemptions": 1000}}, checks=["victim-starvation"]
    )
    assert not report.passed
    assert "starvation bound" in report.summary()


def test_options_for_a_plugin_the_stack_lacks_are_refused(stack_file: Path) -> None:
    with pytest.raises(ValueError, match=r"has no plugin 'lrw-victm'"):
        load_stack(stack_file, {"lrw-victm": {}})


def test_stack_conformance_from_pytest(stack_file: Path, tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tandem",
            "-p",
            "no:cacheprovider",
            "-v",
            "--tandem-conformance-stack",
            str(stack_file),
            "--tandem-conformance-options",
            'lrw-victim={"max_preemptions": 1000}',
            "-k",
            "victim-starvation",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert f"tandem-conformance-stack[{stack_file}]::victim-starvation[sync] FAILED" in out
    assert "2 failed" in out and "needs a starvation bound" in out
