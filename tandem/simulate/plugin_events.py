"""Where an idle simulated engine moves the virtual clock: to the next plugin event.

After a step that ran nothing while requests are unfinished and no step is in flight, the
driver asks `PluginEvents.idle_until`. When every unfinished request is held back by
plugins (`requests_not_ready`) that announce their next change (`next_event_time`, e.g. a
grammar compile finishing on the virtual clock), nothing can happen before the earliest
announced time, so the clock jumps there (the driver also stops at an earlier arrival).
Otherwise (a plugin holds requests back without announcing a time, or a request waits for
something no plugin announces) the clock moves by `IDLE_STEP_S`, a poll. An announced
time that is already due gives one more step at `now` (the next drain point sees it); the
same due time twice in a row falls back to the poll, so a plugin that announces a past
time without acting on it cannot stall the run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.core.plugin_manager import implemented_hooks

if TYPE_CHECKING:
    from tandem.core.engine_core import EngineCore

#: Simulated seconds an engine with unfinished work but nothing runnable waits before it
#: steps again when no plugin announces when that changes.
IDLE_STEP_S = 0.005


class PluginEvents:
    """The engine's plugin events for one simulation (see the module docstring)."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        manager = engine.plugin_manager
        self._hook = manager.hook
        #: Plugins that may hold requests back without announcing when they stop.
        self._silent = [
            plugin
            for plugin in manager.get_plugins()
            if "requests_not_ready" in (hooks := implemented_hooks(type(plugin)))
            and "next_event_time" not in hooks
        ]
        self._due_at: float | None = None
        #: Idle steps that jumped to an announced event, and that polled.
        self.num_jumps, self.num_polls = 0, 0

    def next_event(self) -> float | None:
        """The earliest time a plugin announces (None: none does)."""
        return min((t for t in self._hook.next_event_time() if t is not None), default=None)

    def _waiting_only_for_announced(self) -> bool:
        """Every unfinished request is held back, and no silent plugin holds any."""
        held: set[str] = set()
        for ids in self._hook.requests_not_ready():
            held.update(ids or ())
        state = self.engine.scheduler_state
        unfinished = {r.request_id for r in (*state.waiting, *state.running)}
        if not unfinished or not unfinished <= held:
            return False
        return not any(set(p.requests_not_ready() or ()) & unfinished for p in self._silent)

    def idle_until(self, now: float) -> float:
        """The time to move the clock to after an idle step at `now` (module docstring)."""
        event = self.next_event()
        if event is not None and self._waiting_only_for_announced():
            if event > now:
                self._due_at = None
                self.num_jumps += 1
                return event
            if self._due_at != now:
                self._due_at = now
                return now
        self.num_polls += 1
        return now + IDLE_STEP_S
