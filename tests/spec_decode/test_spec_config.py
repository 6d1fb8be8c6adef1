"""Configuring speculative decoding: the default stack's drafter, stack/config agreement,
and async scheduling against the drafter's declared `aligned_drafts`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tandem.config_resolution import default_stack, resolve_config, resolve_stack
from tandem.core.engine_core import EngineCore
from tandem.schema.config import ConfigError
from tandem.stack_file import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "stacks"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
SCHED_SAMPLER = [{"name": "reference-scheduler"}, {"name": "default-sampler"}]
#: The installed drafter that declares each method (`speculative_methods`).
DRAFTER_FOR_METHOD = {
    "ngram": "ngram-drafter",
    "eagle": "eagle-drafter",
    "draft_model": "draft-model-drafter",
    "scripted": "scripted-drafter",
}


def scripted(**overrides: Any) -> Any:
    settings: dict[str, Any] = {"model": "scripted", "max_model_len": 128, "block_size": 4}
    settings.update(overrides)
    return load_config(None, **settings)


@pytest.mark.parametrize("method", sorted(DRAFTER_FOR_METHOD))
def test_default_stack_adds_the_drafter_of_the_method(method: str) -> None:
    config = scripted(speculative={"method": method, "num_speculative_tokens": 2})
    assert [s.name for s in default_stack(config)] == [
        "reference-scheduler",
        "default-sampler",
        DRAFTER_FOR_METHOD[method],
    ]


def test_default_stack_without_speculative_has_no_drafter() -> None:
    assert [s.name for s in default_stack(scripted())] == [
        "reference-scheduler",
        "default-sampler",
    ]


def test_ngram_default_stack_runs_the_ngram_drafter_in_the_worker() -> None:
    engine = EngineCore(resolve_config(scripted(speculative=NGRAM, async_scheduling=False)))
    worker_pm = engine.executor.worker.plugin_manager  # type: ignore[attr-defined]
    drafters = worker_pm.plugins_with_role("drafter")
    assert [type(d).__name__ for d in drafters] == ["NgramDrafter"]
    assert "ngram-drafter" in engine.plugin_manager.plugin_names()
    engine.shutdown()


def test_explicit_stack_with_speculative_but_no_drafter_is_refused() -> None:
    config = resolve_config(scripted(speculative=NGRAM, async_scheduling=False))
    config.plugins = load_config(None, plugins=SCHED_SAMPLER).plugins
    with pytest.raises(ConfigError) as err:
        resolve_stack(config)
    assert "speculative" in str(err.value) and "no drafter" in str(err.value)
    assert "ngram-drafter" in str(err.value)


def test_drafter_without_speculative_is_refused() -> None:
    config = scripted(plugins=[*SCHED_SAMPLER, {"name": "ngram-drafter"}], async_scheduling=False)
    with pytest.raises(ConfigError) as err:
        resolve_stack(resolve_config(config))
    assert "'ngram-drafter'" in str(err.value) and "speculative" in str(err.value)


def test_aligned_drafter_keeps_async_scheduling_on() -> None:
    assert resolve_config(scripted(speculative=NGRAM)).scheduler.async_scheduling is True


def test_unaligned_drafter_turns_auto_async_off_naming_it(
    unaligned_drafter: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = scripted(speculative=NGRAM, plugins=[*SCHED_SAMPLER, {"name": unaligned_drafter}])
    with caplog.at_level(logging.INFO, logger="tandem.config"):
        resolved = resolve_config(config)
    assert resolved.scheduler.async_scheduling is False
    assert any(
        "async scheduling disabled" in r.getMessage() and unaligned_drafter in r.getMessage()
        for r in caplog.records
    )


def test_unaligned_drafter_with_explicit_async_is_an_error_naming_it(
    unaligned_drafter: str,
) -> None:
    config = scripted(
        speculative=NGRAM,
        plugins=[*SCHED_SAMPLER, {"name": unaligned_drafter}],
        async_scheduling=True,
    )
    with pytest.raises(ConfigError) as err:
        resolve_config(config)
    assert "async_scheduling" in str(err.value) and unaligned_drafter in str(err.value)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_stack_loads_and_resolves(path: Path) -> None:
    """Each shipped stack file passes the config loader and the stack resolver (plugins are
    found, options validate, speculative and drafter agree)."""
    config = load_config(path)
    resolved = resolve_stack(config, str(path))
    names = [entry.name for entry in resolved.entries]
    assert names[0] == "reference-scheduler" or "scheduler" in names[0]
    if config.speculative is not None:
        assert any(getattr(entry.cls, "role", None) == "drafter" for entry in resolved.entries)


def test_ngram_example_stacks_differ_only_in_async_scheduling() -> None:
    sync = load_config(EXAMPLES / "ngram-sync.yaml")
    asyn = load_config(EXAMPLES / "ngram-async.yaml")
    assert sync.speculative is not None and sync.speculative.method == "ngram"
    assert sync.scheduler.async_scheduling is False and asyn.scheduler.async_scheduling is True
    assert sync.speculative == asyn.speculative
