"""How a scheduler asks the policy seams of `tandem.core.hookspecs`: the WAITING queue
(`make_waiting_queue`), the preemption victim (`select_preemption_victim`) and readiness
(`requests_not_ready`), with the checks that name a plugin whose answer breaks the contract.

A scheduler driven without a plugin manager (unit tests) gets `PolicyHooks(None, ...)`: no
plugin queue, its own default victim, everything ready.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import pluggy

from tandem.core.plugin_manager import PluginConfigError
from tandem.core.request import Request
from tandem.core.waiting_queue import WaitingQueue
from tandem.schema.config import EngineConfig


class PolicyHooks:
    """The policy seams as one scheduler sees them.

    `default_victim(running, needed_by)` answers when there is no plugin manager (with one,
    the scheduler registers the same rule as its own `trylast` implementation).
    """

    def __init__(
        self,
        hook: pluggy.HookRelay | None,
        default_victim: Callable[[Sequence[Request], Request], Request],
    ) -> None:
        self._hook = hook
        self._default_victim = default_victim

    def waiting_queue(self, config: EngineConfig) -> WaitingQueue | None:
        """A plugin's WAITING queue, or None (the scheduler keeps its own). Raises
        `PluginConfigError` naming the plugin when the answer is not an empty queue."""
        if self._hook is None:
            return None
        caller = self._hook.make_waiting_queue
        queue = caller(config=config)
        if queue is not None and (not isinstance(queue, WaitingQueue) or len(queue) != 0):
            raise PluginConfigError(
                f"make_waiting_queue: plugin {answering_plugin(caller, config=config)!r} "
                f"returned {type(queue).__name__}, not an empty "
                f"tandem.core.waiting_queue.WaitingQueue"
            )
        return queue

    def victim(self, running: Sequence[Request], needed_by: Request) -> Request:
        """The request to preempt for `needed_by`: always one of `running`, else an error
        naming the plugin that answered."""
        if self._hook is None:
            return self._default_victim(running, needed_by)
        snapshot = tuple(running)
        caller = self._hook.select_preemption_victim
        victim = caller(running=snapshot, needed_by=needed_by)
        if not any(victim is r for r in snapshot):
            name = answering_plugin(caller, running=snapshot, needed_by=needed_by)
            raise RuntimeError(
                f"select_preemption_victim: plugin {name!r} returned {victim!r}, which is not "
                f"one of the RUNNING requests {[r.request_id for r in snapshot]} (needed by "
                f"{needed_by.request_id})"
            )
        return victim

    def not_ready(self) -> Collection[str]:
        """The union of the `requests_not_ready` answers; no hook call when no plugin
        implements it."""
        if self._hook is None or not self._hook.requests_not_ready.get_hookimpls():
            return ()
        answers = [ids for ids in self._hook.requests_not_ready() if ids]
        if len(answers) <= 1:
            return answers[0] if answers else ()
        return set().union(*answers)


def answering_plugin(caller: pluggy.HookCaller, **kwargs: Any) -> str:
    """The name of the plugin whose implementation answers a firstresult hook with these
    arguments: each implementation is asked again, in call order. For error messages only
    (a plugin asked twice may do its work twice)."""
    for impl in reversed(caller.get_hookimpls()):
        if impl.hookwrapper or impl.wrapper:
            continue
        if impl.function(*(kwargs[name] for name in impl.argnames)) is not None:
            return impl.plugin_name
    return "<none>"
