"""Ledger traces: every request's ledger after every step of an engine (a debugging aid)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.core import hookimpl
from tandem.core.engine_core import EngineCore
from tandem.core.outputs import EngineCoreOutput
from tandem.core.scheduler_output import SchedulerOutput


@dataclass
class LedgerStep:
    """One step of `ledger_trace`: the tokens scheduled per request, the outputs, and the
    ledger of every request the scheduler holds after the step."""

    step: int
    scheduled: dict[str, int]
    outputs: list[EngineCoreOutput]
    ledgers: dict[str, dict[str, object]]


class _ScheduleRecorder:
    def __init__(self) -> None:
        self.scheduled: dict[str, int] = {}

    @hookimpl(trylast=True)
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        self.scheduled.update(scheduler_output.num_scheduled_tokens)


def ledger_trace(engine: EngineCore, max_steps: int = 10_000) -> list[LedgerStep]:
    """Step `engine` (`step_fn`) until it has no work and record, per step, what was
    scheduled, the outputs and every request's ledger (`Request.ledger()`) afterwards.
    Raises RuntimeError when the engine is not idle after `max_steps`."""
    recorder = _ScheduleRecorder()
    name = f"tandem-ledger-trace-{id(recorder)}"
    engine.plugin_manager.register(recorder, name=name)
    trace: list[LedgerStep] = []
    try:
        for step in range(1, max_steps + 1):
            if not engine.has_work():
                return trace
            recorder.scheduled = {}
            outputs, _ = engine.step_fn()
            state = engine.scheduler_state
            trace.append(
                LedgerStep(
                    step=step,
                    scheduled=dict(recorder.scheduled),
                    outputs=list(outputs),
                    ledgers={rid: r.ledger() for rid, r in state.requests.items()},
                )
            )
        if not engine.has_work():
            return trace
        raise RuntimeError(f"engine did not become idle within {max_steps} steps")
    finally:
        engine.plugin_manager.unregister(name=name)


def format_ledger_trace(trace: Sequence[LedgerStep]) -> str:
    """A readable dump of a `ledger_trace`: one block per step."""
    lines = []
    for entry in trace:
        lines.append(f"step {entry.step}: scheduled {entry.scheduled}")
        for out in entry.outputs:
            lines.append(f"  out {out.request_id}: {out.new_token_ids} {out.finish_reason or ''}")
        for ledger in entry.ledgers.values():
            lines.append(f"  {ledger}")
    return "\n".join(lines)
