"""The plugin manager: entry-point discovery, stack order, options, contract checks."""

from __future__ import annotations

import pytest

from tandem.core.plugin_manager import PluginConfigError
from tandem.plugin_discovery import discover_plugins
from tandem.schema.config import ConfigError
from tandem.testing import collect_outputs, make_request, make_scripted_engine


def _observer(label: str) -> dict:
    return {"name": "observer", "options": {"label": label}}


def test_installed_plugins_are_discovered_but_inactive(test_plugins) -> None:
    found = discover_plugins()
    assert {"observer", "reference-scheduler", "default-sampler"} <= set(found)
    assert found["observer"].distribution == "tandem-test-plugins"
    engine = make_scripted_engine()
    assert "observer" not in engine.plugin_manager.plugin_names()


@pytest.mark.parametrize("labels", [["a", "b"], ["b", "a"]])
def test_stack_order_is_call_order(test_plugins, labels: list[str]) -> None:
    test_plugins.CALLS.clear()
    stack = ["reference-scheduler", *(_observer(label) for label in labels), "default-sampler"]
    engine = make_scripted_engine(plugins=stack)
    engine.add_request(make_request("r", [3, 4, 5], max_tokens=2))
    collect_outputs(engine)
    first_step = [label for label, step, _ in test_plugins.CALLS if step == 1]
    assert first_step == labels


def test_scheduler_updates_ledger_before_later_plugins_run(test_plugins) -> None:
    seen = []

    engine = make_scripted_engine(
        plugins=["reference-scheduler", _observer("x"), "default-sampler"]
    )
    scheduler = engine.plugin_manager.plugins_with_role("scheduler")[0]
    original = test_plugins.CALLS.append

    def record(item: tuple) -> None:
        rid = item[2]
        if rid is not None:
            seen.append(scheduler.requests[rid].num_computed_tokens)
        original(item)

    test_plugins.CALLS = type("Recorder", (list,), {"append": lambda self, item: record(item)})()
    try:
        engine.add_request(make_request("r", [3, 4, 5, 6], max_tokens=1))
        engine.step()
    finally:
        test_plugins.CALLS = []
    assert seen == [4]


def test_plugin_options_are_validated_with_the_key_path(test_plugins) -> None:
    with pytest.raises(PluginConfigError, match=r"plugins\[1\]\.options: weight"):
        make_scripted_engine(
            plugins=[
                "reference-scheduler",
                {"name": "observer", "options": {"weight": "heavy"}},
                "default-sampler",
            ]
        )
    with pytest.raises(PluginConfigError, match=r"plugins\[1\]\.options: colour: unknown field"):
        make_scripted_engine(
            plugins=[
                "reference-scheduler",
                {"name": "observer", "options": {"colour": 1}},
                "default-sampler",
            ]
        )


def test_unknown_hook_is_reported_by_plugin_name(test_plugins) -> None:
    with pytest.raises(PluginConfigError, match=r"unknown-hook.*not_a_tandem_hook"):
        make_scripted_engine(plugins=["reference-scheduler", "unknown-hook", "default-sampler"])


def test_wrong_hook_signature_is_reported_by_plugin_name(test_plugins) -> None:
    with pytest.raises(PluginConfigError, match=r"(?s)wrong-signature.*budget"):
        make_scripted_engine(plugins=["reference-scheduler", "wrong-signature", "default-sampler"])


def test_plugin_import_failure_names_plugin_and_cause(test_plugins) -> None:
    with pytest.raises(
        PluginConfigError, match=r"'broken'.*failed to import.*missing dependency foo"
    ):
        make_scripted_engine(plugins=["reference-scheduler", "broken", "default-sampler"])


def test_stack_without_scheduler_is_rejected() -> None:
    with pytest.raises(PluginConfigError, match="no scheduler"):
        make_scripted_engine(plugins=["default-sampler"])


def test_async_layer_is_added_after_the_scheduler_when_async_resolves_on() -> None:
    engine = make_scripted_engine(async_scheduling=True)
    assert list(engine.plugin_manager.plugin_names()) == [
        "reference-scheduler",
        "async-scheduler",
        "default-sampler",
    ]
    assert engine.step_fn == engine.step_with_batch_queue


def test_async_layer_without_async_scheduling_is_an_error() -> None:
    with pytest.raises(ConfigError, match="async-scheduler needs scheduler.async_scheduling"):
        make_scripted_engine(plugins=["reference-scheduler", "async-scheduler", "default-sampler"])
