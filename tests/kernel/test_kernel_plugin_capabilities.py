"""Plugins declare the names they answer and the resolver reads them: the config has no
closed lists of plugin names, a third-party drafter and a third-party grammar backend are
selected by their own names, and conflicting or missing declarations are clear errors."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from third_party_plugins import (
    EchoDrafter,
    EvenGrammar,
    NeedsTokenizerGrammar,
    OtherEchoDrafter,
    expected_even_output,
)

from tandem.core.plugin_manager import PluginConfigError
from tandem.core.worker.model_loader import model_loader_for
from tandem.models.hf_loader import HFModelLoader
from tandem.plugin_discovery import register_plugin, unregister_plugin
from tandem.schema.config import SpeculativeConfig, StructuredOutputConfig
from tandem.testing import collect_outputs, make_request, make_scripted_engine
from tandem.testing.engine import expected_scripted_output
from tandem.testing.scripted_loader import ScriptedModelLoader

ROOT = Path(__file__).resolve().parents[2]
SCHED_SAMPLER = ["reference-scheduler", "default-sampler"]
ECHO = {"method": "echo", "num_speculative_tokens": 3}
PROMPTS = {"a": [3, 4, 5, 6], "b": [7, 8], "c": [9, 10, 11, 12, 13]}


@pytest.fixture
def echo_installed() -> Iterator[None]:
    register_plugin("echo-drafter", EchoDrafter)
    yield
    unregister_plugin("echo-drafter")


@pytest.fixture
def even_installed() -> Iterator[None]:
    register_plugin("even-grammar", EvenGrammar)
    yield
    unregister_plugin("even-grammar")


def test_the_config_lists_no_plugin_names() -> None:
    assert SpeculativeConfig.model_fields["method"].annotation is str
    assert StructuredOutputConfig.model_fields["backend"].annotation is str


def test_the_kernel_and_policy_packages_do_not_name_the_scripted_model() -> None:
    """A model kind comes from the loader that claims it, never from a literal."""
    found = []
    for package in ("core", "plugins", "spec_decode", "structured_output", "kv"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value == "scripted":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found


def test_a_model_kind_comes_from_the_loader_that_claims_it() -> None:
    assert model_loader_for("scripted") is ScriptedModelLoader
    assert not ScriptedModelLoader.has_tokenizer and ScriptedModelLoader.simulatable
    for model in ("default", "/some/hf/dir", "org/name", "model.gguf"):
        assert model_loader_for(model) is HFModelLoader


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_third_party_drafter_is_selected_by_its_method(
    echo_installed: None, async_scheduling: bool
) -> None:
    engine = make_scripted_engine(speculative=ECHO, async_scheduling=async_scheduling)
    assert engine.plugin_manager.plugin_names()[-1] == "echo-drafter"
    params = {"max_tokens": 12, "ignore_eos": True}
    for rid, prompt in PROMPTS.items():
        engine.add_request(make_request(rid, prompt, **params))
    outputs = collect_outputs(engine)
    scheduler = engine.plugin_manager.plugins_with_role("scheduler")[0]
    engine.shutdown()
    for rid, prompt in PROMPTS.items():
        want = expected_scripted_output(
            prompt, make_request(rid, prompt, **params).sampling_params, 128, 1, 256
        )
        assert outputs[rid] == want
    metrics = scheduler.spec_metrics
    assert metrics.num_draft_tokens > 0
    assert metrics.num_accepted_tokens == metrics.num_draft_tokens  # every echo draft is right


def test_a_drafter_class_in_an_explicit_stack_answers_its_method() -> None:
    engine = make_scripted_engine(
        speculative=ECHO, plugins=[*SCHED_SAMPLER, EchoDrafter], async_scheduling=False
    )
    assert engine.plugin_manager.plugin_names()[-1] == "third_party_plugins:EchoDrafter"
    engine.add_request(make_request("r", PROMPTS["a"], max_tokens=6, ignore_eos=True))
    assert len(collect_outputs(engine)["r"][0]) == 6
    scheduler = engine.plugin_manager.plugins_with_role("scheduler")[0]
    assert scheduler.spec_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_third_party_grammar_backend_is_selected_by_its_name(
    even_installed: None, async_scheduling: bool
) -> None:
    engine = make_scripted_engine(backend="even-only", async_scheduling=async_scheduling)
    assert engine.plugin_manager.plugin_names() == [
        "reference-scheduler",
        *(["async-scheduler"] if async_scheduling else []),
        "default-sampler",
        "even-grammar",
    ]
    engine.add_request(
        make_request(
            "c", PROMPTS["c"], max_tokens=10, ignore_eos=True, structured_outputs={"custom": {}}
        )
    )
    engine.add_request(make_request("u", PROMPTS["a"], max_tokens=10, ignore_eos=True))
    outputs = collect_outputs(engine)
    engine.shutdown()
    constrained = outputs["c"][0]
    assert constrained == expected_even_output(PROMPTS["c"], 10, 128)
    assert all(t % 2 == 0 for t in constrained)
    assert any(t % 2 for t in outputs["u"][0])  # the unconstrained request is not masked
    params = make_request("u", PROMPTS["a"], max_tokens=10, ignore_eos=True).sampling_params
    assert outputs["u"] == expected_scripted_output(PROMPTS["a"], params, 128, 1, 256)


def test_without_its_backend_named_the_grammar_plugin_stays_out(even_installed: None) -> None:
    assert "even-grammar" not in make_scripted_engine().plugin_manager.plugin_names()


def test_two_installed_drafters_declaring_one_method_name_both(echo_installed: None) -> None:
    register_plugin("other-echo-drafter", OtherEchoDrafter)
    try:
        with pytest.raises(PluginConfigError) as err:
            make_scripted_engine(speculative=ECHO)
    finally:
        unregister_plugin("other-echo-drafter")
    message = str(err.value)
    assert "speculative.method: 'echo' is declared by 2 installed drafter plugins" in message
    assert "echo-drafter" in message and "other-echo-drafter" in message


def test_an_undeclared_method_names_the_field_the_value_and_the_declared_names() -> None:
    with pytest.raises(PluginConfigError) as err:
        make_scripted_engine(speculative={"method": "telepathy", "num_speculative_tokens": 2})
    message = str(err.value)
    assert "speculative.method: no installed drafter plugin declares 'telepathy'" in message
    for declared in ("draft_model", "eagle", "ngram", "scripted"):
        assert declared in message


def test_an_undeclared_backend_names_the_field_the_value_and_the_declared_names() -> None:
    with pytest.raises(PluginConfigError) as err:
        make_scripted_engine(backend="telepathy")
    message = str(err.value)
    assert "structured_output.backend: no installed grammar plugin declares 'telepathy'" in message
    for declared in ("auto", "xgrammar", "outlines", "fake"):
        assert declared in message


def test_a_drafter_declaring_other_methods_is_refused() -> None:
    with pytest.raises(
        PluginConfigError,
        match=r"plugins\[2\]: speculative\.method is 'scripted' but ngram-drafter declares ngram",
    ):
        make_scripted_engine(
            speculative={"method": "scripted", "num_speculative_tokens": 2},
            plugins=[*SCHED_SAMPLER, "ngram-drafter"],
            async_scheduling=False,
        )


def test_a_grammar_plugin_declaring_other_backends_is_refused() -> None:
    with pytest.raises(
        PluginConfigError,
        match="structured_output.backend is 'xgrammar' but fake-grammar declares fake",
    ):
        make_scripted_engine(backend="xgrammar", plugins=[*SCHED_SAMPLER, "fake-grammar"])


def test_a_grammar_plugin_needing_a_tokenizer_is_refused_on_a_model_without_one() -> None:
    with pytest.raises(
        PluginConfigError, match="needs a model with a tokenizer; the 'scripted' model has none"
    ):
        make_scripted_engine(plugins=[*SCHED_SAMPLER, NeedsTokenizerGrammar])


def test_two_grammar_plugins_are_a_conflict_naming_both() -> None:
    with pytest.raises(
        PluginConfigError,
        match=r"2 plugins claim the grammar role \(fake-grammar, third_party_plugins:EvenGrammar\)",
    ):
        make_scripted_engine(plugins=[*SCHED_SAMPLER, "fake-grammar", EvenGrammar])
