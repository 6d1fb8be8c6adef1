"""The plugin is found through its `tandem.plugins` entry point only, by name, and stacks
with the reference scheduler from a YAML file."""

from __future__ import annotations

import pytest
from tandem import LLM, SamplingParams, load_config
from tandem.cli import main as tandem_cli
from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore
from tandem.plugin_discovery import discover_plugins, load_plugin_class
from tandem.testing import expected_scripted_output

from _helpers import EOS, STACK, VOCAB, prompt, req, run_exact, victim_plugin
from tandem_lrw.victim import LRWVictim


def test_discovery_reports_the_distribution() -> None:
    info = discover_plugins()["lrw-victim"]
    assert info.distribution == "tandem-lrw"
    assert info.version == "0.1.0"
    assert info.value == "tandem_lrw.victim:LRWVictim"
    assert load_plugin_class("lrw-victim") is LRWVictim


def test_cli_shows_who_answers_the_victim_hook(capsys: pytest.CaptureFixture[str]) -> None:
    assert tandem_cli(["config", "show", str(STACK)]) == 0
    shown = capsys.readouterr().out
    assert "0. reference-scheduler" in shown
    assert "2. lrw-victim" in shown  # after the async layer, inserted after the scheduler
    # The reference scheduler's own choice is `trylast`: the stacked plugin answers.
    assert "select_preemption_victim: lrw-victim" in shown


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_engine_from_yaml_stack(async_scheduling: bool) -> None:
    config = resolve_config(load_config(STACK, async_scheduling=async_scheduling))
    engine = EngineCore(config, source=str(STACK))
    try:
        names = ["reference-scheduler", "lrw-victim", "default-sampler"]
        if async_scheduling:
            names.insert(1, "async-scheduler")
        assert engine.plugin_manager.plugin_names() == names
        assert victim_plugin(engine).max_preemptions == 2
        requests = [req(f"r{i}", 6 + 7 * i, 20 + 9 * (i % 3)) for i in range(6)]
        assert sum(run_exact(engine, requests).values()) > 0  # the small pool preempts
        assert victim_plugin(engine).victims
    finally:
        engine.shutdown()


def test_llm_front_door_with_the_stack() -> None:
    llm = LLM(config=STACK)
    prompts = [prompt(f"p{i}", 3 + 11 * i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert type(victim_plugin(llm.engine)) is LRWVictim
    for p, out in zip(prompts, outs, strict=True):
        want = expected_scripted_output(p, params, VOCAB, EOS, llm.config.max_model_len)
        assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == want
