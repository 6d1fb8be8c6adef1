"""A simulated device that runs in the engine's thread: engine and device time never overlap.

`VirtualDeviceExecutor` models an accelerator beside the host: under async scheduling the
engine plans step n+1 while step n runs, and step n's tokens come out when step n ends.
The `inprocess` executor on a CPU is different: `execute_model` computes the step in the
engine's own thread before it returns, so nothing overlaps, and under async scheduling the
batch queue hands out step n's tokens only after step n+1 has been computed (one step
later than the virtual device says: TTFT and E2E grow by about one step, TPOT does not).
`VirtualDeviceExecutor(overlap=False)` reproduces that: the clock moves to a step's end as
soon as the step is handed over. Under synchronous scheduling it gives the overlapping
device's timeline exactly (the engine waits for each step at once either way).

Use it for a stack calibrated (`tandem simulate calibrate`) on an executor that runs the
worker in the engine's thread (the fit file's `stack.executor` is `inprocess`) when the
stack schedules asynchronously: `simulate_inline`, or `tandem simulate --inline-device`.
"""

from __future__ import annotations

from typing import Any

from tandem.core.clock import VirtualClock
from tandem.core.worker.virtual_device import VirtualDeviceExecutor
from tandem.schema.config import EngineConfig
from tandem.simulate.driver import SimulationResult, simulate


class InlineDeviceExecutor(VirtualDeviceExecutor):
    """`VirtualDeviceExecutor` with `overlap=False`: the device is the engine's thread."""

    def __init__(self, config: EngineConfig, clock: VirtualClock, *args: Any, **kw: Any) -> None:
        super().__init__(config, clock, *args, **kw)
        self.overlap = False


def simulate_inline(config: EngineConfig, traffic: Any, **kwargs: Any) -> SimulationResult:
    """`simulate(config, traffic, overlap=False, **kwargs)`."""
    return simulate(config, traffic, overlap=False, **kwargs)
