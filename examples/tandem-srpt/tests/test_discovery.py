"""The plugin is found through its `tandem.plugins` entry point only, by name."""

from __future__ import annotations

import pytest
from tandem import LLM, SamplingParams, load_config
from tandem.cli import main as tandem_cli
from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore
from tandem.plugin_discovery import discover_plugins, load_plugin_class
from tandem.testing import collect_outputs, expected_scripted_output

from _helpers import EOS, STACK, VOCAB, expected, order_of, prompt, queue_of, req
from tandem_srpt.order import SRPTOrder


def test_discovery_reports_the_distribution() -> None:
    info = discover_plugins()["srpt-order"]
    assert info.distribution == "tandem-srpt"
    assert info.version == "0.1.0"
    assert info.value == "tandem_srpt.order:SRPTOrder"
    assert load_plugin_class("srpt-order") is SRPTOrder


def test_cli_lists_and_shows_the_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    assert tandem_cli(["plugins", "list"]) == 0
    listing = capsys.readouterr().out
    line = next(ln for ln in listing.splitlines() if ln.startswith("srpt-order"))
    assert "(tandem-srpt 0.1.0)" in line
    block = listing[listing.index(line) :]
    options = next(ln for ln in block.splitlines()[1:] if ln.lstrip().startswith("options:"))
    assert "aging_rate" in options  # the options schema line of this plugin's block

    assert tandem_cli(["plugins", "show", "srpt-order"]) == 0
    shown = capsys.readouterr().out
    assert '"aging_rate": 64.0' in shown
    assert "Starvation bound" in shown


def test_cli_config_show_resolves_the_yaml_stack(capsys: pytest.CaptureFixture[str]) -> None:
    assert tandem_cli(["config", "show", str(STACK)]) == 0
    shown = capsys.readouterr().out
    assert "0. reference-scheduler" in shown
    assert "1. async-scheduler" in shown  # added after the scheduler by its role
    assert "2. srpt-order" in shown
    assert "make_waiting_queue: srpt-order" in shown
    assert "schedule: reference-scheduler" in shown


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_engine_from_yaml_stack(async_scheduling: bool) -> None:
    config = resolve_config(load_config(STACK, async_scheduling=async_scheduling))
    engine = EngineCore(config, source=str(STACK))
    try:
        expected_names = ["reference-scheduler", "srpt-order", "default-sampler"]
        if async_scheduling:
            expected_names.insert(1, "async-scheduler")
        assert engine.plugin_manager.plugin_names() == expected_names
        order = order_of(engine)
        assert type(order) is SRPTOrder
        assert order.aging_rate == 16.0
        assert queue_of(engine).aging_rate == 16.0  # the scheduler's WAITING queue
        requests = [req(f"r{i}", 4 + 9 * i, 6 + 5 * (i % 3)) for i in range(6)]
        for r in requests:
            engine.add_request(r)
        got = collect_outputs(engine)
        for r in requests:
            assert got[r.request_id] == expected(r, config.max_model_len)
    finally:
        engine.shutdown()


def test_llm_front_door_with_the_stack() -> None:
    llm = LLM(config=STACK)
    prompts = [prompt(f"p{i}", 3 + 11 * i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert type(order_of(llm.engine)) is SRPTOrder
    assert queue_of(llm.engine).aging_rate == 16.0
    for p, out in zip(prompts, outs, strict=True):
        want = expected_scripted_output(p, params, VOCAB, EOS, llm.config.max_model_len)
        assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == want
