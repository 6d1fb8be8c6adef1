"""The inline simulated device (`tandem/simulate/inline_device.py`): no engine/device overlap.

Synchronous scheduling gives the virtual device's timeline exactly; under async scheduling
a step's tokens come out one step later (after the next step has run), as the `inprocess`
executor on a CPU does, and the virtual device's overlap disappears."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin
from tandem.core.worker.step_shape import StepShape
from tandem.core.worker.virtual_device import EngineTime
from tandem.simulate.driver import simulate
from tandem.simulate.inline_device import simulate_inline
from tandem.simulate.traffic import TrafficRequest
from tandem.stack_file import load_config

STEP_S, TOKEN_S = 0.010, 0.001


class LinearCost(TandemPlugin):
    """10 ms per step plus 1 ms per token."""

    @hookimpl
    def step_cost(self, step: StepShape) -> float:
        return STEP_S + TOKEN_S * step.num_tokens


def config(async_: bool) -> Any:
    return load_config(
        model="scripted",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        async_scheduling=async_,
        plugins=["reference-scheduler", "default-sampler", f"{__name__}:LinearCost"],
    )


TRAFFIC = [TrafficRequest(0.05 * i, 20 + 7 * i, 5 + i % 4) for i in range(10)]
ENGINE = EngineTime(step_s=0.002, per_request_s=0.0001)


def times(result: Any) -> dict[str, list[float]]:
    return {t.request_id: t.token_times_s for t in result.timelines}


def flat(result: Any) -> list[float]:
    return [
        x for t in sorted(result.timelines, key=lambda t: t.request_id) for x in t.token_times_s
    ]


def test_sync_scheduling_gives_the_virtual_devices_timeline() -> None:
    stock = simulate(config(False), TRAFFIC, engine_time=ENGINE)
    inline = simulate_inline(config(False), TRAFFIC, engine_time=ENGINE)
    assert times(inline).keys() == times(stock).keys()
    assert flat(inline) == pytest.approx(flat(stock))
    assert inline.busy_s == pytest.approx(stock.busy_s)


def test_async_tokens_come_out_after_the_next_step() -> None:
    lone = [TrafficRequest(0.0, 40, 3)]
    result = simulate_inline(config(True), lone, engine_time=EngineTime())
    prefill, decode = STEP_S + 40 * TOKEN_S, STEP_S + TOKEN_S
    # The prefill's token is handed out after the first decode step has run.
    assert result.timelines[0].token_times_s[0] == pytest.approx(prefill + decode)
    stock = simulate(config(True), lone, engine_time=EngineTime())
    assert stock.timelines[0].token_times_s[0] == pytest.approx(prefill)


def test_async_first_tokens_come_later_than_on_the_virtual_device() -> None:
    stock = simulate(config(True), TRAFFIC, engine_time=ENGINE)
    inline = simulate_inline(config(True), TRAFFIC, engine_time=ENGINE)
    assert [len(t) for t in times(inline).values()] == [len(t) for t in times(stock).values()]
    ttft = [sum(t.token_times_s[0] - t.arrival_s for t in r.timelines) for r in (stock, inline)]
    assert ttft[1] > ttft[0]
