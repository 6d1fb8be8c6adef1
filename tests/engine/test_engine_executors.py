"""Worker-thread and worker-process executors: same outputs as in-process, sync and async."""

from __future__ import annotations

import pytest

from tandem.core.worker.executors import ThreadExecutor
from tandem.testing import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    make_scripted_engine,
)

PROMPTS = [[3, 4, 5, 6, 7], [9] * 13, [2, 7, 1, 8, 2, 8], list(range(10, 40))]


def _run(executor: str, async_scheduling: bool) -> dict[str, tuple[list[int], str | None]]:
    engine = make_scripted_engine(
        executor=None,
        parallel={"executor": executor},
        async_scheduling=async_scheduling,
        max_num_batched_tokens=16,
        num_kv_blocks=40,
        block_size=4,
        max_model_len=64,
    )
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(make_request(str(i), prompt, max_tokens=12, ignore_eos=True))
        return collect_outputs(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_executor_gives_exact_outputs(executor: str, async_scheduling: bool) -> None:
    outputs = _run(executor, async_scheduling)
    from tandem.schema.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        assert outputs[str(i)] == expected_scripted_output(prompt, params, 128, 1, 64)


def test_executor_classes_are_registered_by_name() -> None:
    engine = make_scripted_engine(parallel={"executor": "thread"})
    try:
        assert isinstance(engine.executor, ThreadExecutor)
    finally:
        engine.shutdown()
