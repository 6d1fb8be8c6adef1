"""The distribution builds as a wheel laid out as DESIGN.md section 2 says, and imports."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_maps_design_folders_to_subpackages_and_imports(tmp_path: Path) -> None:
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheel_dir.glob("tandem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "tandem/__init__.py",
        "tandem/core/engine_core.py",
        "tandem/core/worker/model_runner.py",
        "tandem/core/worker/csrc/paged_decode.cpp",  # compiled on first use
        "tandem/kv/kv_cache_manager.py",
        "tandem/plugins/reference_scheduler.py",
        "tandem/testing/pytest_plugin.py",
    ):
        assert expected in names, expected
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[tandem.plugins]" in text and "reference-scheduler" in text

    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    probe = (
        "import tandem, tandem.core.engine_core, tandem.kv, tandem.plugins.reference_scheduler;"
        "from tandem import LLM, SamplingParams;"
        "print(tandem.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert result.stdout.strip().startswith(str(target))
