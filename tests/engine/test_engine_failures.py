"""One request's failure ends that request alone; a step failure no request explains stops
the engine with a clear error instead of leaving requests RUNNING with no way forward."""

from __future__ import annotations

import pytest

from tandem.core.engine_core import EngineDeadError
from tandem.core.plugin_manager import PluginConfigError
from tandem.core.worker.executors import WorkerProcessError
from tandem.schema.sampling_params import SamplingParams
from tandem.testing import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    make_scripted_engine,
)

FAULTY_STACK = [
    "reference-scheduler",
    {"name": "fault-sampler", "options": {"fail_top_k": 13}},
    "default-sampler",
]
PROMPTS = {"a": [3, 4, 5, 6, 7], "b": [9] * 13, "c": [2, 7, 1, 8, 2, 8], "d": list(range(10, 40))}
GOOD = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _expected(prompt: list[int]) -> tuple[list[int], str]:
    return expected_scripted_output(prompt, GOOD, 128, 1, 64)


@pytest.mark.parametrize(
    ("executor", "async_scheduling"),
    [("inprocess", False), ("inprocess", True), ("thread", True), ("process", False)],
)
def test_failing_request_ends_alone_and_the_engine_keeps_serving(
    executor: str, async_scheduling: bool
) -> None:
    engine = make_scripted_engine(
        parallel={"executor": executor},
        plugins=FAULTY_STACK,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=16,
        num_kv_blocks=40,
        max_model_len=64,
    )
    try:
        for rid, prompt in PROMPTS.items():
            engine.add_request(make_request(rid, prompt, max_tokens=10, ignore_eos=True))
        engine.add_request(make_request("bad", [5, 6, 7], max_tokens=10, temperature=1.0, top_k=13))
        outputs = collect_outputs(engine)
        assert outputs["bad"][1] == "error"
        assert outputs["bad"][0] == []  # no token of a failed step reaches the client
        for rid, prompt in PROMPTS.items():
            assert outputs[rid] == _expected(prompt), rid
        # The same engine serves the next batch, the failing request's id included.
        for rid in ("bad", "e"):
            engine.add_request(make_request(rid, PROMPTS["a"], max_tokens=10, ignore_eos=True))
        again = collect_outputs(engine)
        assert again == {"bad": _expected(PROMPTS["a"]), "e": _expected(PROMPTS["a"])}
        assert engine.scheduler_state.kv_cache_manager.block_pool.usage == 0.0
    finally:
        engine.shutdown()


def test_failure_reason_names_the_failure() -> None:
    engine = make_scripted_engine(plugins=FAULTY_STACK, max_model_len=64)
    engine.add_request(make_request("bad", [5, 6, 7], temperature=1.0, top_k=13))
    errors = [o.error for o in engine.run_until_idle() if o.finish_reason == "error"]
    assert len(errors) == 1 and "injected failure" in errors[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_failure_stops_the_engine_with_a_clear_error(async_scheduling: bool) -> None:
    # Nothing answers `sample`: a failure of the whole step, not of one request.
    engine = make_scripted_engine(
        plugins=["reference-scheduler", {"name": "fault-sampler", "options": {"fail_top_k": None}}],
        async_scheduling=async_scheduling,
    )
    for rid, prompt in PROMPTS.items():
        engine.add_request(make_request(rid, prompt, max_tokens=4))
    outputs = []
    for _ in range(10):  # bounded: a dead engine has no work left
        if not engine.has_work():
            break
        outputs += engine.run_step()[0]
    assert not engine.has_work()
    finished = {o.request_id: o for o in outputs if o.finished}
    assert set(finished) == set(PROMPTS)
    assert all(
        o.finish_reason == "error" and "sample" in (o.error or "") for o in finished.values()
    )
    with pytest.raises(EngineDeadError, match="engine stopped"):
        engine.add_request(make_request("late", [1, 2, 3]))


def test_llm_generate_after_a_dead_engine_raises_instead_of_hanging() -> None:
    from tandem import LLM

    llm = LLM(
        model="scripted",
        plugins=["reference-scheduler", {"name": "fault-sampler", "options": {"fail_top_k": None}}],
        max_model_len=64,
        num_kv_blocks=32,
        block_size=4,
    )
    # the failure is the engine's, not one request's: generate raises with the reason
    with pytest.raises(EngineDeadError, match="sample"):
        llm.generate([[3, 4, 5], [6, 7, 8]], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(EngineDeadError):
        llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=4))


def test_worker_process_step_error_reaches_the_engine_with_its_traceback() -> None:
    engine = make_scripted_engine(
        parallel={"executor": "process"},
        plugins=["reference-scheduler", {"name": "fault-sampler", "options": {"fail_top_k": None}}],
    )
    try:
        engine.add_request(make_request("r", [3, 4, 5], max_tokens=2))
        with pytest.raises(WorkerProcessError, match="(?s)Traceback.*sample.*hook"):
            engine.step()
    finally:
        engine.shutdown()
    assert not engine.executor.process.is_alive()


def test_stack_without_a_sampler_is_refused_at_resolution() -> None:
    with pytest.raises(PluginConfigError, match="no sampler.*default-sampler"):
        make_scripted_engine(plugins=["reference-scheduler"])
