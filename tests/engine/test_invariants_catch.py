"""The invariant checker names the broken ledger field (negative controls for the checks
every engine test relies on)."""

from __future__ import annotations

import pytest

from tandem.plugins.invariant_checker import InvariantViolation, check_invariants
from tandem.testing import make_request, make_scripted_engine


def running_engine():  # noqa: ANN201
    engine = make_scripted_engine(async_scheduling=True, num_kv_blocks=32, max_model_len=64)
    engine.add_request(make_request("r", [3, 4, 5, 6], max_tokens=8, ignore_eos=True))
    engine.step_with_batch_queue()
    check_invariants(engine.scheduler_state, step=1, idle=False)  # healthy first
    return engine


def test_safe_frontier_below_zero_is_caught() -> None:
    engine = running_engine()
    request = engine.scheduler_state.requests["r"]
    assert request.safe_frontier == request.num_computed_tokens - request.num_output_placeholders
    request.num_output_placeholders = request.num_computed_tokens + 1
    with pytest.raises(InvariantViolation, match="safe_frontier"):
        check_invariants(engine.scheduler_state, step=1, idle=False)


def test_negative_stale_count_is_caught() -> None:
    engine = running_engine()
    engine.scheduler_state.requests["r"].num_stale_output_tokens = -1
    with pytest.raises(InvariantViolation, match="num_stale_output_tokens"):
        check_invariants(engine.scheduler_state, step=1, idle=False)


def test_placeholders_beyond_the_tokens_in_flight_are_caught() -> None:
    """A scheduler that forgets to resolve placeholders leaves more of them than tokens in
    flight; the kernel's own checker names it (before the model runner trips over it)."""
    engine = running_engine()
    request = engine.scheduler_state.requests["r"]
    request.num_output_placeholders = request.num_in_flight_tokens + 1
    request.num_computed_tokens += 1  # keep the safe frontier itself valid
    with pytest.raises(InvariantViolation, match="num_output_placeholders <= num_in_flight"):
        check_invariants(engine.scheduler_state, step=1, idle=False)
