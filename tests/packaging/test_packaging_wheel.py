"""The distribution builds as a wheel laid out as DESIGN.md section 2 says, without
setuptools warnings, and imports."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What setuptools prints for deprecated or ambiguous packaging metadata.
BUILD_WARNING = re.compile(
    r"SetuptoolsDeprecationWarning|BuildBackendWarning|is deprecated|would be ignored", re.I
)


def test_wheel_maps_design_folders_to_subpackages_and_imports(tmp_path: Path) -> None:
    wheel_dir = tmp_path / "wheel"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheel_dir),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    warnings = [
        line.strip()
        for line in (build.stdout + build.stderr).splitlines()
        if BUILD_WARNING.search(line)
    ]
    assert not warnings, warnings
    (wheel,) = wheel_dir.glob("tandem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "tandem/__init__.py",
        "tandem/core/engine_core.py",
        "tandem/core/worker/model_runner.py",
        "tandem/models/csrc/paged_decode.cpp",  # compiled on first use
        "tandem/kv/kv_cache_manager.py",
        "tandem/plugins/reference_scheduler.py",
        "tandem/testing/pytest_plugin.py",
        "tandem/testing/conformance/__init__.py",
        "tandem/testing/conformance/rules.py",
    ):
        assert expected in names, expected
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA")))
    assert "License-Expression: Apache-2.0" in metadata.decode()
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert 'matplotlib>=3.5; extra == "trace"' in metadata.decode()  # `tandem trace` draws
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[tandem.plugins]" in text and "reference-scheduler" in text
    for double in ("scripted-drafter", "fake-grammar", "fault-sampler"):  # test kit only
        assert f"\n{double} =" not in text
    assert "[tandem.model_loaders]" in text and "ScriptedModelLoader" in text

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
