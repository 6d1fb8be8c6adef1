"""The engine's one clock. Policy code reads time only through it.

`WallClock` (the default) is `time.monotonic`. `VirtualClock` is a simulated device's
clock (`tandem simulate`): it stands still until the simulation driver or the simulated
executor moves it, so an hour of traffic runs in minutes and every timestamp a plugin
records (arrival, queueing, aging) is simulated seconds. The engine core owns one clock
and the plugin manager sets it on every plugin as `plugin.clock` before the stack starts.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (never decreasing; origin unspecified)."""
        ...


class WallClock:
    """The host's monotonic clock."""

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Simulated seconds from `start`, moved only by `advance_to`. Invariant: never
    decreases (moving it back raises)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        """Move to `t` (>= now; a `t` below now by float rounding only is ignored)."""
        if t < self._now - 1e-9:
            raise ValueError(f"VirtualClock: cannot go back from {self._now} to {t}")
        self._now = max(self._now, t)


WALL_CLOCK = WallClock()
