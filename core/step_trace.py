"""Step tracing: timed spans per lane (engine CPU work, device work), for timelines.

The engine records its own spans (schedule, update_after_schedule, execute/sample launch,
wait, update_from_output); an executor that knows its device time (the simulated device)
contributes device spans. `to_chrome_trace` writes the Chrome trace-event format
(chrome://tracing, Perfetto).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(slots=True)
class Span:
    lane: str
    name: str
    start: float
    end: float
    step_id: int = -1


@dataclass
class StepTracer:
    """Collects spans; `span()` times a block on a lane."""

    spans: list[Span] = field(default_factory=list)

    @contextmanager
    def span(self, lane: str, name: str, step_id: int = -1) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(lane, name, start, time.perf_counter(), step_id))

    def add(self, span: Span) -> None:
        self.spans.append(span)

    def to_chrome_trace(
        self, process: str, pid: int = 0, origin: float | None = None
    ) -> list[dict]:
        """Trace events in microseconds from `origin` (the first span by default)."""
        if not self.spans:
            return []
        t0 = origin if origin is not None else min(s.start for s in self.spans)
        lanes = sorted({s.lane for s in self.spans})
        events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}}
        ]
        for tid, lane in enumerate(lanes):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}}
            )
        for s in self.spans:
            events.append(
                {
                    "name": s.name,
                    "ph": "X",
                    "pid": pid,
                    "tid": lanes.index(s.lane),
                    "ts": (s.start - t0) * 1e6,
                    "dur": (s.end - s.start) * 1e6,
                    "args": {"step": s.step_id},
                }
            )
        return events
