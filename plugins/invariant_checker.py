"""Ledger and KV invariants, checked after every step: a plugin on a pluggy wrapper hook.

Turned on by the top-level config flag `check_invariants` (the kernel then attaches this
plugin, found like any plugin by its entry-point name `invariant-checker`); a stack may also
name it. Its `update_from_output` wrapper checks once every implementation has applied the
step, and raises `InvariantViolation` out of that hook call (so out of the engine's step).

Per request: `num_output_placeholders >= 0`, `num_computed_tokens - num_output_placeholders
>= 0` (the safe frontier), `num_stale_output_tokens >= 0`, `num_in_flight_tokens >= 0`,
`num_output_placeholders <= num_in_flight_tokens` (a step's returned tokens must resolve its
placeholders), `num_computed_tokens <= num_tokens_with_spec + num_output_placeholders`, and
every RUNNING request holds KV blocks for all computed tokens. KV: every block is exactly one
of free, cached-and-free, held (ref count = holders) or waiting for a fence; when the engine is
idle (no request waiting or running, and the KV fence closed: every scheduled step processed,
one whose sampling was deferred included), every block is free.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin, TandemPluginManager
from tandem.core.scheduler_state import SchedulerState
from tandem.schema.config import EngineConfig

if TYPE_CHECKING:
    from tandem.core.engine_core import EngineCore


class InvariantViolation(AssertionError):
    """An invariant broke. The message names the invariant, the step, the request and its
    ledger."""


def ledger_violations(state: SchedulerState) -> list[str]:
    problems = []
    for request in state.requests.values():
        checks = (
            ("num_output_placeholders >= 0", request.num_output_placeholders >= 0),
            (
                "safe_frontier (num_computed_tokens - num_output_placeholders) >= 0",
                request.safe_frontier >= 0,
            ),
            ("num_stale_output_tokens >= 0", request.num_stale_output_tokens >= 0),
            ("num_in_flight_tokens >= 0", request.num_in_flight_tokens >= 0),
            (
                # A placeholder stands for a sampled token whose step is still in flight.
                "num_output_placeholders <= num_in_flight_tokens",
                request.num_output_placeholders <= request.num_in_flight_tokens,
            ),
            (
                "num_computed_tokens <= num_tokens_with_spec + num_output_placeholders",
                request.num_computed_tokens
                <= request.num_tokens_with_spec + request.num_output_placeholders,
            ),
        )
        for name, ok in checks:
            if not ok:
                problems.append(f"{name} violated by {request.request_id}: {request.ledger()}")
    kv = state.kv_cache_manager
    for request in state.running:
        held = len(kv.get_block_ids(request.request_id)) * kv.block_size
        if held < request.num_computed_tokens:
            problems.append(
                f"RUNNING request holds KV for all computed tokens violated by "
                f"{request.request_id}: {held} slots < {request.num_computed_tokens}: "
                f"{request.ledger()}"
            )
    return problems


def check_invariants(state: SchedulerState, step: int, idle: bool) -> None:
    """Raise `InvariantViolation` for the first broken invariants after `step`.

    `idle` is the caller's judgement that no request is waiting or running and no step is
    in flight, a step whose sampling is deferred included (its blocks are still behind
    its fence); only then must every block be free."""
    problems = ledger_violations(state)
    problems += [f"KV: {p}" for p in state.kv_cache_manager.check_invariants()]
    if idle and not state.kv_cache_manager.all_blocks_free():
        kv = state.kv_cache_manager
        problems.append(
            f"KV: every block is free when idle violated: {kv.num_free_blocks} of "
            f"{kv.num_blocks} free, {kv.num_fenced_blocks} waiting for a fence"
        )
    if problems:
        raise InvariantViolation(f"after step {step}:\n" + "\n".join(problems))


class InvariantChecker(TandemPlugin):
    """Checks the invariants after every `update_from_output` (the engine's step count)."""

    name: ClassVar[str] = "invariant-checker"
    attached_by: ClassVar[str | None] = "check_invariants"

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        self.manager: TandemPluginManager | None = None
        self.num_steps = 0

    @classmethod
    def attach(cls, engine: EngineCore) -> InvariantChecker:
        """Register a checker on `engine` unless its stack already has one."""
        manager = engine.plugin_manager
        found = manager.get_plugin(cls.name)
        if found is None:
            found = cls(engine.config, cls.Options())
            found.manager = manager
            manager.register(found, cls.name)
        return found

    @hookimpl
    def tandem_stack_loaded(self, manager: TandemPluginManager) -> None:
        self.manager = manager

    @hookimpl(wrapper=True)
    def update_from_output(self) -> Generator[None, Any, Any]:
        results = yield
        self.num_steps += 1
        assert self.manager is not None
        hook = self.manager.hook
        state: SchedulerState = hook.scheduler_state()
        kv = state.kv_cache_manager
        idle = not hook.has_unfinished_requests() and kv.processed_step_seq == kv.scheduled_step_seq
        check_invariants(state, self.num_steps, idle)
        return results
