"""The decode stagger (specification, async scheduling with pipeline parallelism): after a
request is scheduled for decode at step s, the async layer sets `next_decode_eligible_step =
s + decode_stagger`, and the scheduler does not decode it again before that step. The
default stagger is `pipeline_parallel_size` (1 step: no restriction on one stage); the
outputs never change, only the cadence."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from tandem.core.engine_core import EngineCore
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.executors import InProcessExecutor
from tandem.schema.sampling_params import SamplingParams
from tandem.testing.engine import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    scripted_config,
)

PROMPTS = {"a": [3, 4, 5], "b": [6, 7, 8, 9, 10, 11], "c": [12, 13], "d": list(range(20, 40))}
MAX_TOKENS = 9


class RecordingExecutor(InProcessExecutor):
    """Records, per step id, the requests scheduled for decode (computed past the prompt)."""

    def __init__(self, config) -> None:  # noqa: ANN001
        super().__init__(config)
        self.decodes: dict[str, list[int]] = {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        for cached in scheduler_output.scheduled_cached_reqs:
            if cached.num_computed_tokens >= len(PROMPTS[cached.req_id]):
                self.decodes.setdefault(cached.req_id, []).append(scheduler_output.step_id)
        return super().execute_model(scheduler_output)


def _run(**overrides: object) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    config = scripted_config(async_scheduling=True, max_num_batched_tokens=8, **overrides)
    executor = RecordingExecutor(config)
    engine = EngineCore(config, executor=executor)
    try:
        for rid, prompt in PROMPTS.items():
            engine.add_request(make_request(rid, prompt, max_tokens=MAX_TOKENS, ignore_eos=True))
        outputs = collect_outputs(engine)
    finally:
        engine.shutdown()
    return {rid: tokens for rid, (tokens, _) in outputs.items()}, executor.decodes


def _expected(rid: str) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return expected_scripted_output(PROMPTS[rid], params, 128, 1, 256)[0]


@pytest.mark.parametrize("stagger", [2, 3])
def test_a_request_is_never_decoded_within_the_stagger(stagger: int) -> None:
    tokens, decodes = _run(decode_stagger=stagger)
    assert tokens == {rid: _expected(rid) for rid in PROMPTS}
    gaps = [b - a for steps in decodes.values() for a, b in zip(steps, steps[1:], strict=False)]
    assert gaps and min(gaps) >= stagger


def test_the_default_stagger_on_one_stage_is_one_step() -> None:
    tokens, decodes = _run()
    assert tokens == {rid: _expected(rid) for rid in PROMPTS}
    gaps = [b - a for steps in decodes.values() for a, b in zip(steps, steps[1:], strict=False)]
    assert min(gaps) == 1  # back-to-back decodes: the check above could fail


def test_the_stagger_resolves_to_the_pipeline_size_and_is_validated() -> None:
    config = scripted_config(async_scheduling=True)
    assert config.scheduler.decode_stagger is None and config.parallel.pipeline_parallel_size == 1
    with pytest.raises(Exception, match="decode_stagger"):  # noqa: PT011 - pydantic or ConfigError
        scripted_config(async_scheduling=True, decode_stagger=0)
