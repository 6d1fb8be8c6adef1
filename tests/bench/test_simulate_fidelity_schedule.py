"""benchmarks/simulate_fidelity.py's calibration schedule: every later calibration runs
exactly once, between measured rounds or after the last, in order. No model runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def fidelity() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # it imports fidelity_probe and fidelity_replay by name
    try:
        spec = importlib.util.spec_from_file_location(
            "simulate_fidelity", BENCHMARKS / "simulate_fidelity.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["simulate_fidelity"] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("calibrations", [1, 2, 3, 5])
@pytest.mark.parametrize("repeats", [1, 2, 3, 5])
def test_every_later_calibration_runs_once_in_order(
    fidelity: ModuleType, calibrations: int, repeats: int
) -> None:
    schedule = fidelity.calibration_schedule(calibrations, repeats)
    order = [j for round_ in sorted(schedule) for j in schedule[round_]]
    assert order == list(range(1, calibrations))  # calibration 0 runs before measuring
    assert all(0 <= round_ <= repeats for round_ in schedule)


def test_three_calibrations_spread_over_three_rounds(fidelity: ModuleType) -> None:
    assert fidelity.calibration_schedule(3, 3) == {1: [1], 2: [2]}
    assert fidelity.calibration_schedule(3, 5) == {2: [1], 3: [2]}
