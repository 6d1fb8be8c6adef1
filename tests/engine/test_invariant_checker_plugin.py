"""The `invariant-checker` plugin: attached by `check_invariants`, it checks after every
step's `update_from_output` (after every implementation) and, once the engine is idle, that
every KV block is free."""

from __future__ import annotations

import pytest

from tandem.core import hookimpl
from tandem.plugins.invariant_checker import InvariantChecker, InvariantViolation
from tandem.testing import collect_outputs, make_request, make_scripted_engine


class LeakOnLastUpdate:
    """After the scheduler's update (it runs later in call order), once nothing is left,
    takes one KV block for a request nobody knows: a leak only the idle check can see."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.engine = engine

    @hookimpl(trylast=True)
    def update_from_output(self) -> None:
        state = self.engine.scheduler_state
        if not state.requests and state.kv_cache_manager.all_blocks_free():
            state.kv_cache_manager.allocate_slots(make_request("ghost", [5, 6, 7], max_tokens=1), 3)


def test_attached_by_the_flag_only() -> None:
    on = make_scripted_engine(check_invariants=True)
    assert isinstance(on.plugin_manager.get_plugin("invariant-checker"), InvariantChecker)
    off = make_scripted_engine(check_invariants=False)
    assert off.plugin_manager.get_plugin("invariant-checker") is None


def test_a_broken_ledger_fails_the_next_step() -> None:
    engine = make_scripted_engine(check_invariants=True, async_scheduling=True)
    engine.add_request(make_request("r", [3, 4, 5, 6], max_tokens=8, ignore_eos=True))
    engine.step_fn()
    engine.step_fn()
    engine.scheduler_state.requests["r"].num_stale_output_tokens = -1
    with pytest.raises(InvariantViolation, match=r"after step \d+:\nnum_stale_output_tokens"):
        engine.step_fn()


def test_idle_check_sees_a_block_leaked_after_the_last_step() -> None:
    engine = make_scripted_engine(check_invariants=True)
    engine.plugin_manager.register(LeakOnLastUpdate(engine), "leaker")
    engine.add_request(make_request("r", [3, 4, 5], max_tokens=3, ignore_eos=True))
    with pytest.raises(InvariantViolation, match="every block is free when idle"):
        collect_outputs(engine)


def test_the_same_leak_passes_unchecked() -> None:
    engine = make_scripted_engine(check_invariants=False)
    engine.plugin_manager.register(LeakOnLastUpdate(engine), "leaker")
    engine.add_request(make_request("r", [3, 4, 5], max_tokens=3, ignore_eos=True))
    outputs = collect_outputs(engine)
    assert len(outputs["r"][0]) == 3
