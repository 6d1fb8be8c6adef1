"""The simulated-device executor: scripted tokens, cost-model time, recorded device spans."""

from __future__ import annotations

import pytest

from tandem.core.worker.simulated_executor import SimulatedExecutor
from tandem.core.worker.step_shape import StepShape
from tandem.core.worker.virtual_device import roofline_seconds
from tandem.schema.config import SimulatedDeviceConfig
from tandem.schema.sampling_params import SamplingParams
from tandem.testing import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    make_scripted_engine,
)

PROMPTS = [[3, 4, 5, 6, 7], [9] * 13, list(range(10, 30))]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_simulated_executor_gives_exact_outputs_and_records_every_step(
    async_scheduling: bool,
) -> None:
    engine = make_scripted_engine(
        parallel={"executor": "simulated"},
        async_scheduling=async_scheduling,
        max_num_batched_tokens=16,
        max_model_len=64,
    )
    try:
        assert isinstance(engine.executor, SimulatedExecutor)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(make_request(str(i), prompt, max_tokens=6, ignore_eos=True))
        outputs = collect_outputs(engine)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            assert outputs[str(i)] == expected_scripted_output(prompt, params, 128, 1, 64)
        executed = [s for s in engine.executor.spans if s.kind == "execute"]
        assert len(executed) == engine.num_steps
        assert all(s.end >= s.start for s in executed)
    finally:
        engine.shutdown()


def test_cost_model_is_the_slower_of_compute_and_memory() -> None:
    cost = SimulatedDeviceConfig()
    # One decode token: reading 16 GB of weights dominates 16 GFLOP of compute.
    one = roofline_seconds(cost, StepShape(query_lens=(1,), context_lens=(511,)))
    assert one == pytest.approx(
        (cost.weight_bytes + 512 * cost.kv_bytes_per_token) / cost.bytes_per_s
    )
    # A 8192-token prefill is compute-bound.
    big = roofline_seconds(cost, StepShape(query_lens=(8192,), context_lens=(0,)))
    assert big == pytest.approx(8192 * cost.flops_per_token / cost.flops_per_s)
    assert roofline_seconds(cost, StepShape(query_lens=(), context_lens=())) == 0.0


def test_simulated_executor_refuses_a_real_model() -> None:
    from tandem.core.worker.simulated_executor import SimulatedExecutor as Sim
    from tandem.schema.config import ConfigError
    from tandem.stack_file import load_config

    config = load_config(None, model="/nonexistent", executor="simulated")
    with pytest.raises(ConfigError, match="scripted"):
        Sim(config)
