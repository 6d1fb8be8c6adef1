"""How fast is this machine now, against just after the calibration? A short step probe.

On a shared machine the real engine's speed moves with the load (a 2-core host running
other jobs: several times between quiet and busy), so a fit measured a few minutes earlier
can be off by a common factor for a whole run. `SpeedProbe` keeps a real engine (the same
stack, synchronous, in this process) and times a fixed sequence of steps: three prefills
of 64 tokens, one 4 x 64-token fill and up to six decodes of 4 requests. Built right after
the calibration, it times that sequence once as its baseline; `factor()` times it again
and returns the median over the steps of now / baseline: 1.0 means the machine runs as it
did after calibrating, 2.0 twice as slow. (Comparing with the fit's predictions instead
would fold the fit's own residuals on these few shapes into the factor.) The benchmark
probes before and after every measured run and scales the fit's device coefficients by
the mean factor for its "probe-normalised" prediction: one number per run, measured apart
from the run, the same for every metric (not fitted to the results).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

from tandem.core.engine_core import EngineCore
from tandem.plugins.cost_models.calibrated import CalibrationFit
from tandem.schema.config import EngineConfig
from tandem.simulate.step_profile import GridProfiler

#: Steps timed per probe (3 prefills, the fill, 6 decodes).
PROBE_STEPS = 10


class SpeedProbe:
    """A real engine kept for probing (see the module docstring). `close()` frees it."""

    def __init__(self, config: EngineConfig) -> None:
        if config.scheduler.async_scheduling:
            raise ValueError("SpeedProbe: needs a synchronous config")
        self.engine = EngineCore(config, source="simulate_fidelity probe")
        self.profiler = GridProfiler(self.engine, math.inf, repeats=3, log=lambda _: None)
        self.profiler.warm_up()
        self.baseline = self.times()

    def times(self) -> list[float]:
        """Device seconds of each step of the probe's sequence, in order."""
        profiler = self.profiler
        profiler.samples.clear()
        profiler.prefill(64)
        for _ in range(4):
            profiler.add(64, 8)
        while profiler.step("probe") is not None and len(profiler.samples) < PROBE_STEPS:
            pass
        profiler.drain()
        return [s.device_s for s in profiler.samples]

    def factor(self) -> float:
        """Median over the sequence's steps of now / baseline seconds."""
        pairs = zip(self.times(), self.baseline, strict=False)  # equal lengths in practice
        ratios = [now / then for now, then in pairs if then > 0]
        return statistics.median(ratios) if ratios else 1.0

    def close(self) -> None:
        self.profiler.timer.restore()
        self.engine.shutdown()


def scaled(fit: CalibrationFit, factor: float) -> CalibrationFit:
    """`fit` with every device coefficient multiplied by `factor` (engine time kept)."""
    return replace(fit, coef=tuple(c * factor for c in fit.coef))
