"""benchmarks/simulate_fidelity.py's calibration schedule (every later calibration runs
exactly once, between measured rounds or after the last, in order) and
benchmarks/fidelity_sensitivity.py's arithmetic (elasticities from two predictions a known
power law apart, the device-time factor that closes a gap). No model runs."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
STEP = 0.05


@pytest.fixture(scope="module")
def sensitivity() -> ModuleType:
    """fidelity_sensitivity, loaded with benchmarks/ on the path (it imports
    simulate_fidelity, fidelity_probe and fidelity_replay by name)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(
            "fidelity_sensitivity", BENCHMARKS / "fidelity_sensitivity.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["fidelity_sensitivity"] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def fidelity(sensitivity: ModuleType) -> ModuleType:
    return sys.modules["simulate_fidelity"]


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


def summary(device_time: float) -> dict:
    """A summary whose figures follow known power laws of the device-time factor: TTFT p50
    linear, TTFT p90 cubic, TPOT p50 square root, TPOT p90 missing, throughput inverse,
    output throughput constant."""
    return {
        "ttft_ms": {"p50": 100.0 * device_time, "p90": 300.0 * device_time**3},
        "tpot_ms": {"p50": 30.0 * device_time**0.5, "p90": None},
        "request_throughput": 4.0 / device_time,
        "output_throughput": 150.0,
    }


def test_elasticities_recover_the_power_laws(sensitivity: ModuleType) -> None:
    e = sensitivity.elasticities(summary(1 - STEP), summary(1 + STEP), STEP)
    assert e["ttft_ms.p50"] == pytest.approx(1.0)
    assert e["ttft_ms.p90"] == pytest.approx(3.0)
    assert e["tpot_ms.p50"] == pytest.approx(0.5)
    assert e["tpot_ms.p90"] is None
    assert e["request_throughput"] == pytest.approx(-1.0)
    assert e["output_throughput"] == pytest.approx(0.0)


def test_implied_factor_closes_the_gap(sensitivity: ModuleType) -> None:
    e = sensitivity.elasticities(summary(1 - STEP), summary(1 + STEP), STEP)
    # The real device ran 8% slower than the fit: measured = summary(1.08).
    measured, predicted = summary(1.08), summary(1.0)
    ratio = {
        "ttft_ms.p50": predicted["ttft_ms"]["p50"] / measured["ttft_ms"]["p50"],
        "ttft_ms.p90": predicted["ttft_ms"]["p90"] / measured["ttft_ms"]["p90"],
        "tpot_ms.p50": predicted["tpot_ms"]["p50"] / measured["tpot_ms"]["p50"],
        "tpot_ms.p90": None,
        "request_throughput": predicted["request_throughput"] / measured["request_throughput"],
        "output_throughput": 1.0,
    }
    implied = sensitivity.implied_factors(ratio, e)
    for name in ("ttft_ms.p50", "ttft_ms.p90", "tpot_ms.p50", "request_throughput"):
        assert implied[name] == pytest.approx(1.08), name
    assert implied["tpot_ms.p90"] is None  # nothing measured
    assert implied["output_throughput"] is None  # does not depend on speed


def test_a_figure_that_barely_moves_gives_no_factor(sensitivity: ModuleType) -> None:
    small = sensitivity.MIN_ELASTICITY / 2
    implied = sensitivity.implied_factors({"x": 0.5}, {"x": small})
    assert implied["x"] is None
    assert math.isclose(sensitivity.implied_factors({"x": 0.5}, {"x": 1.0})["x"], 2.0)
