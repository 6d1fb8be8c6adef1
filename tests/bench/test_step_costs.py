"""benchmarks/step_costs.py's per-step phase split (issue 16 item 2), on the scripted model:
the phases of every step are non-negative and add up to the step's wall time, decode steps
are found, and the instrumentation leaves nothing patched behind. No timing is asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tandem import LLM, SamplingParams
from tandem.testing.tiny_model import save_tiny_model

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
#: Float rounding of `elapsed - nested` (seconds); anything below this is a real error.
ROUNDING_S = 1e-9


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # step_costs imports step_phases by name
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def modules() -> tuple[ModuleType, ModuleType]:
    return _load("step_phases"), _load("step_costs")


@pytest.mark.parametrize("use_async", [True, False])
def test_phases_sum_to_each_step(modules: tuple[ModuleType, ModuleType], use_async: bool) -> None:
    step_phases, _ = modules
    llm = LLM(model="scripted", async_scheduling=use_async, max_num_seqs=8, max_model_len=128)
    try:
        hook, runner = llm.engine.hook, llm.engine.executor.worker.model_runner
        before = (hook.schedule, hook.update_from_output, llm.engine.run_step, runner.model.forward)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        with step_phases.instrument(llm) as clock:
            outs = llm.generate([[5 + i, 7, 9, 11] * 2 for i in range(8)], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
        after = (hook.schedule, hook.update_from_output, llm.engine.run_step, runner.model.forward)
        assert after == before  # every wrapper removed
        assert "_sample" not in vars(runner) and "process" not in vars(llm.output_processor)
    finally:
        llm.shutdown()
    assert clock.steps
    for step in clock.steps:
        assert all(v >= -ROUNDING_S for v in step.phases.values()), step.phases
        assert sum(step.phases.values()) == pytest.approx(step.wall_s, rel=0.01)
    decodes = [s for s in clock.steps if s.is_decode(8)]
    assert len(decodes) >= 5
    for step in decodes:  # the engine's and the runner's phases were all seen
        assert {"schedule", "prepare_inputs", "forward_other", "sampling"} <= set(step.phases)


def test_measure_summary_adds_up(modules: tuple[ModuleType, ModuleType]) -> None:
    _, step_costs = modules
    result = step_costs.measure("decode-sync", model="scripted", num=8, max_tokens=10)
    assert result["steps"] >= 5
    assert all(v >= -ROUNDING_S for v in result["phase_ms"].values())
    total = sum(result["category_ms"].values())
    assert total == pytest.approx(result["step_ms"], rel=0.01)
    assert sum(result["phase_pct"].values()) == pytest.approx(100, rel=0.01)
    table = step_costs.table({"x": step_costs.aggregate([result])})
    assert "remainder | python_overhead" in table


def test_real_model_splits_linears_and_logits(
    modules: tuple[ModuleType, ModuleType], tmp_path: Path
) -> None:
    """On a transformers model (the fused decoder), the linears and the LM head are timed
    as their own phases, whichever linear type holds the weights, and the wrapped head
    still computes the real logits: the same greedy tokens as an uninstrumented run."""
    step_phases, _ = modules
    model = save_tiny_model("llama", tmp_path / "llama")
    llm = LLM(model=str(model), max_num_seqs=4, max_model_len=64, kv_cache_memory_gib=0.01)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        prompts = [[3 + i, 17, 29, 41] for i in range(4)]
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        head_type = type(llm.engine.executor.worker.model_runner.model.lm_head)
        with step_phases.instrument(llm) as clock:
            outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain
        assert "__call__" not in vars(llm.engine.executor.worker.model_runner.model.lm_head)
        assert (
            head_type.__call__
            is type(llm.engine.executor.worker.model_runner.model.lm_head).__call__
        )
    finally:
        llm.shutdown()
    decodes = [s for s in clock.steps if s.is_decode(4)]
    assert decodes
    for step in decodes:
        assert {"linears", "logits", "forward_other"} <= set(step.phases), step.phases
