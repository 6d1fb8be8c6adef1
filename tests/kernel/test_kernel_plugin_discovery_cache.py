"""Entry-point discovery is scanned once and kept, yet sees a plugin installed later."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tandem.core import entry_points
from tandem.core.entry_points import plugin_entry_points
from tandem.plugin_discovery import discover_plugins


def _write_dist(root: Path, name: str) -> None:
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[tandem.plugins]\n{name} = os:getcwd\n")


def test_discovery_is_kept_between_calls() -> None:
    assert plugin_entry_points() is plugin_entry_points()


def test_a_distribution_installed_later_in_a_known_directory_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert "late-plugin" not in discover_plugins()
    _write_dist(tmp_path, "late-plugin")  # changes the directory's mtime, not sys.path
    importlib.invalidate_caches()
    assert "late-plugin" in discover_plugins()


def test_a_directory_removed_from_sys_path_is_forgotten(tmp_path: Path) -> None:
    _write_dist(tmp_path, "passing-plugin")
    sys.path.append(str(tmp_path))
    importlib.invalidate_caches()
    try:
        assert "passing-plugin" in discover_plugins()
    finally:
        sys.path.remove(str(tmp_path))
    assert "passing-plugin" not in discover_plugins()
    assert entry_points._scans.get(entry_points.ENTRY_POINT_GROUP) is not None
