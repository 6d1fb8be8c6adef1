"""Registering a plugin by class (`LLM(plugins=[MyScheduler])`), by import path (`name:
module:Class` in a stack file or a keyword), the process-executor rule (a class crosses as
its import path; one that cannot be imported by path is an error naming it), the test kit's
doubles resolvable without shipping as entry points, and one resolved stack per engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from third_party_plugins import EchoDrafter

from tandem import LLM, SamplingParams
from tandem.core import hookimpl
from tandem.core.plugin_manager import PluginConfigError, stack_of
from tandem.core.scheduler_output import SchedulerOutput
from tandem.plugin_discovery import discover_plugins, load_plugin_class
from tandem.plugins.reference_scheduler import ReferenceScheduler
from tandem.schema.config import EngineConfig
from tandem.testing import TEST_PLUGINS, make_scripted_engine, make_scripted_llm
from tandem.testing.engine import expected_scripted_output

SAMPLER = "default-sampler"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class CountingScheduler(ReferenceScheduler):
    """The reference scheduler, counting its `schedule` calls (a policy under test)."""

    def __init__(self, config: EngineConfig, options: object) -> None:
        super().__init__(config, options)  # type: ignore[arg-type]
        self.calls = 0

    @hookimpl  # an override of a hook is marked again
    def schedule(self) -> SchedulerOutput:
        self.calls += 1
        return super().schedule()


def _expected(prompt: list[int]) -> list[int]:
    return expected_scripted_output(prompt, GREEDY, 128, 1, 256)[0]


def test_a_class_in_the_plugins_keyword_is_registered_by_class() -> None:
    llm = make_scripted_llm(plugins=[CountingScheduler, SAMPLER])
    out = llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)
    (scheduler,) = llm.engine.plugin_manager.plugins_with_role("scheduler")
    assert type(scheduler) is CountingScheduler and scheduler.calls > 0
    assert out[0].outputs[0].token_ids == _expected([3, 4, 5])
    name = f"{__name__}:CountingScheduler"
    assert llm.engine.plugin_manager.plugin_names() == [name, SAMPLER]


def test_a_class_or_a_name_with_options_as_a_pair() -> None:
    with pytest.raises(PluginConfigError, match=r"plugins\[0\]\.options: colour"):
        make_scripted_llm(plugins=[(CountingScheduler, {"colour": "red"}), SAMPLER])
    with pytest.raises(PluginConfigError, match=r"plugins\[1\]\.options: colour"):
        make_scripted_llm(plugins=[CountingScheduler, (SAMPLER, {"colour": "red"})])


def test_an_import_path_in_the_plugins_keyword() -> None:
    llm = make_scripted_llm(plugins=[f"{__name__}:CountingScheduler", SAMPLER])
    (scheduler,) = llm.engine.plugin_manager.plugins_with_role("scheduler")
    assert type(scheduler) is CountingScheduler


def test_an_import_path_as_a_stack_file_entry(tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "model: {model: scripted, max_model_len: 256}\n"
        "plugins:\n"
        f"  - name: {__name__}:CountingScheduler\n"
        "  - name: default-sampler\n"
    )
    llm = LLM(config=stack, async_scheduling=True)
    assert llm.engine.plugin_manager.plugin_names() == [
        f"{__name__}:CountingScheduler",
        "async-scheduler",
        SAMPLER,
    ]
    out = llm.generate([[7, 8, 9]], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == _expected([7, 8, 9])


def test_a_path_that_does_not_import_names_the_stack_entry(tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text(
        "model: {model: scripted}\nplugins:\n  - reference-scheduler\n  - name: nowhere.at_all:Sampler\n"
    )
    with pytest.raises(PluginConfigError) as err:
        LLM(config=stack)
    assert str(err.value).startswith(f"{stack}:4: plugins[1].name: plugin 'nowhere.at_all:Sampler'")
    assert "failed to import: ModuleNotFoundError" in str(err.value)


def test_a_local_class_with_the_process_executor_is_an_error_naming_it() -> None:
    class LocalScheduler(ReferenceScheduler):
        pass

    with pytest.raises(PluginConfigError) as err:
        make_scripted_llm(plugins=[LocalScheduler, SAMPLER], executor="process")
    message = str(err.value)
    assert "plugins[0]: plugin" in message and "<locals>.LocalScheduler" in message
    assert "cannot be imported by its path" in message and "'process'" in message
    # In-process the same class is fine: nothing crosses a process boundary.
    make_scripted_engine(plugins=[LocalScheduler, SAMPLER]).shutdown()


def test_a_main_module_class_with_the_process_executor_is_an_error() -> None:
    main_class = type("MainScheduler", (ReferenceScheduler,), {"__module__": "__main__"})
    with pytest.raises(PluginConfigError, match=r"__main__:MainScheduler\) cannot be imported"):
        make_scripted_llm(plugins=[main_class, SAMPLER], executor="process")


def test_an_importable_class_crosses_the_process_boundary_by_path() -> None:
    """The drafter runs in the worker process: it was rebuilt there from its path."""
    llm = make_scripted_llm(
        executor="process",
        async_scheduling=False,
        speculative={"method": "echo", "num_speculative_tokens": 2},
        plugins=["reference-scheduler", SAMPLER, EchoDrafter],
    )
    try:
        specs = llm.config.resolved_stack
        assert specs is not None and specs[-1].plugin is EchoDrafter
        assert specs[-1].model_dump(mode="json")["plugin"] == "third_party_plugins:EchoDrafter"
        out = llm.generate([[3, 4, 5], [9, 8]], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [_expected([3, 4, 5]), _expected([9, 8])]
        scheduler = llm.engine.plugin_manager.plugins_with_role("scheduler")[0]
        assert scheduler.spec_metrics.num_accepted_tokens > 0
    finally:
        llm.engine.shutdown()


def test_the_stack_is_resolved_once_and_shared_by_engine_and_worker() -> None:
    engine = make_scripted_engine(async_scheduling=True)
    worker = engine.executor.worker  # type: ignore[attr-defined]
    assert engine.plugin_manager.resolved is worker.plugin_manager.resolved
    assert engine.plugin_manager.resolved is stack_of(engine.config)


def test_a_serialised_config_rebuilds_the_same_stack_from_paths() -> None:
    engine = make_scripted_engine(
        speculative={"method": "scripted", "num_speculative_tokens": 2}, async_scheduling=True
    )
    text = engine.config.model_dump_json()  # what crosses a process boundary: no objects
    rebuilt = stack_of(EngineConfig.model_validate_json(text))
    original = engine.plugin_manager.resolved
    assert [(e.name, e.cls) for e in rebuilt.entries] == [(e.name, e.cls) for e in original.entries]
    assert rebuilt is not original


def test_test_doubles_resolve_by_name_without_shipping_as_entry_points() -> None:
    installed = discover_plugins()
    for name, cls in TEST_PLUGINS.items():
        assert name not in installed
        assert load_plugin_class(name) is cls


def test_registered_names_come_after_installed_ones() -> None:
    from tandem.plugin_discovery import register_plugin, unregister_plugin

    register_plugin("reference-scheduler", CountingScheduler)
    try:
        assert load_plugin_class("reference-scheduler") is ReferenceScheduler
    finally:
        unregister_plugin("reference-scheduler")
