"""What the front end knows of an engine core's liveness, from the messages it receives.

An engine core's output thread sends an `EngineCoreHeartbeat` (its busy loop's step count
and whether it has work) whenever it has sent nothing for `HEARTBEAT_INTERVAL_S`; any other
message also shows it alive, and outputs show a step finished. An engine core is not live
when it has not been heard from for `heartbeat_timeout_s` (frozen: SIGSTOP, swapped out) or
has had work without finishing a step for `stall_timeout_s` (stuck).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.engine.messages import EngineCoreHeartbeat

#: An engine core not heard from for this long is not live (seconds).
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
#: An engine core busy without finishing a step for this long is stuck (seconds).
DEFAULT_STALL_TIMEOUT_S = 300.0


@dataclass(slots=True)
class EngineLiveness:
    """What the reader thread last heard from one engine core (monotonic seconds)."""

    heard_at: float
    steps: int = 0
    steps_moved_at: float = 0.0
    busy: bool = False

    def hear(self, message: Any, now: float) -> None:
        self.heard_at = now
        if isinstance(message, EngineCoreHeartbeat):
            if message.num_steps != self.steps or not message.has_work:
                self.steps, self.steps_moved_at = message.num_steps, now
            self.busy = message.has_work
        else:  # outputs: a step finished
            self.steps_moved_at = now

    def problem(self, now: float, heartbeat_timeout_s: float, stall_timeout_s: float) -> str:
        """Why this engine is not live, or "" when it is."""
        if now - self.heard_at > heartbeat_timeout_s:
            return f"no heartbeat for {now - self.heard_at:.1f} s"
        if self.busy and now - self.steps_moved_at > stall_timeout_s:
            return f"no step finished for {now - self.steps_moved_at:.1f} s"
        return ""
