"""Fuzz-suite plumbing: the run's totals in the terminal summary."""

from __future__ import annotations

import pytest
from fuzz_harness import STATS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if STATS.workloads or STATS.failures:
        terminalreporter.write_line(f"fuzz: {STATS.summary()}")
