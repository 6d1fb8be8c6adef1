"""`pytest -p tandem --tandem-conformance NAME` end to end, in a fresh process and an empty
directory: the reference scheduler passes all (check, mode) items; a broken scheduler,
installed the way a third-party plugin is (a distribution declaring a `tandem.plugins`
entry point), fails with the check and the rule in the report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.testing.conformance import CHECKS, MODES
from tandem.testing.pytest_plugin import _conformance_options

STARVING_PLUGIN = """
from tandem.plugins.reference_scheduler import ReferenceScheduler
from tandem.plugins.request_queue import FCFSQueue


class NewestFirst(FCFSQueue):
    def add(self, request):
        self._queue.appendleft(request)


class StarvingScheduler(ReferenceScheduler):
    def __init__(self, config, options):
        super().__init__(config, options)
        self.waiting = NewestFirst()
"""


def run_pytest(
    cwd: Path, *args: str, pythonpath: Path | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tandem", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def install_starving_plugin(site: Path) -> None:
    """A distribution on `site` declaring `starving-scheduler` under `tandem.plugins`."""
    site.mkdir()
    (site / "starving_plugin.py").write_text(STARVING_PLUGIN)
    info = site / "starving_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: starving-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[tandem.plugins]\nstarving-scheduler = starving_plugin:StarvingScheduler\n"
    )


def test_reference_scheduler_passes_in_an_empty_directory(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, "--tandem-conformance", "reference-scheduler", "-v")
    assert result.returncode == 0, result.stdout + result.stderr
    passed = [line.split()[0] for line in result.stdout.splitlines() if line.endswith("%]")]
    assert passed == [
        f"tandem-conformance[reference-scheduler]::{check}[{mode}]"
        for check in CHECKS
        for mode in MODES
    ], result.stdout
    assert f"{len(CHECKS) * len(MODES)} passed" in result.stdout


def test_an_installed_starving_scheduler_fails_beside_the_reference(tmp_path: Path) -> None:
    install_starving_plugin(tmp_path / "site")
    work = tmp_path / "work"
    work.mkdir()
    result = run_pytest(
        work,
        "--tandem-conformance",
        "reference-scheduler",
        "--tandem-conformance",
        "starving-scheduler",
        "-k",
        "bounded-wait",
        "-q",
        pythonpath=tmp_path / "site",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 failed, 2 passed" in result.stdout
    for mode in MODES:
        assert f"FAILED tandem-conformance[starving-scheduler]::bounded-wait[{mode}]" in (
            result.stdout
        )
        assert f"plugin 'starving-scheduler' failed check 'bounded-wait' [{mode}]" in (
            result.stdout
        )
    assert "invariant: bounded wait" in result.stdout
    assert "ledger: {'request_id'" in result.stdout


def test_options_reach_the_plugin(tmp_path: Path) -> None:
    result = run_pytest(
        tmp_path,
        "--tandem-conformance",
        "reference-scheduler",
        "--tandem-conformance-options",
        '{"colour": "blue"}',
        "-k",
        "greedy-parity and not async",
        "-q",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed" in result.stdout
    assert "the stack loads and starts" in result.stdout and "colour" in result.stdout


class _Config:
    """A stand-in for `pytest.Config` holding the conformance options."""

    def __init__(self, options: list[str], names: list[str], stacks: list[str] = ()) -> None:
        self.values = {
            "tandem_conformance_options": options,
            "tandem_conformance": names,
            "tandem_conformance_stack": list(stacks),
        }

    def getoption(self, name: str) -> list[str]:
        return self.values[name]


def test_conformance_options_must_be_a_json_object() -> None:
    one = ["reference-scheduler"]
    assert _conformance_options(_Config([], one)) == {}  # type: ignore[arg-type]
    legacy = _conformance_options(_Config(['{"a": 1}'], one))  # type: ignore[arg-type]
    assert legacy == {"reference-scheduler": {"a": 1}}
    with pytest.raises(pytest.UsageError, match="invalid JSON"):
        _conformance_options(_Config(["{nope"], one))  # type: ignore[arg-type]
    with pytest.raises(pytest.UsageError, match="JSON object"):
        _conformance_options(_Config(["reference-scheduler=[1]"], one))  # type: ignore[arg-type]
