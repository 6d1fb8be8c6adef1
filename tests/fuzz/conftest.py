"""Fuzz-suite plumbing: memoised entry-point discovery while a fuzz test runs, and the
run's totals in the terminal summary."""

from __future__ import annotations

from collections.abc import Iterator
from importlib import metadata
from typing import Any

import pytest
from fuzz_harness import STATS

import tandem.core.plugin_manager as plugin_manager


class _MemoisedMetadata:
    """`importlib.metadata` whose `entry_points(...)` is computed once per query.

    Building an engine resolves its stack through ~12 entry-point scans of every installed
    distribution (about half of a small fuzz run); the fuzz builds ~1,000 engines and
    installs nothing while it runs."""

    def __init__(self) -> None:
        self._cache: dict[tuple[tuple[str, Any], ...], Any] = {}

    def entry_points(self, **params: Any) -> Any:
        key = tuple(sorted(params.items()))
        if key not in self._cache:
            self._cache[key] = metadata.entry_points(**params)
        return self._cache[key]

    def __getattr__(self, name: str) -> Any:
        return getattr(metadata, name)


@pytest.fixture(autouse=True)
def _memoised_entry_points(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(plugin_manager, "metadata", _MemoisedMetadata())
    yield


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if STATS.workloads or STATS.failures:
        terminalreporter.write_line(f"fuzz: {STATS.summary()}")
