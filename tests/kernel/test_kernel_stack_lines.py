"""Bad stack files: errors say `file:line:` and the key path (and the plugins involved)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.config_resolution import resolve_config
from tandem.core.engine_core import EngineCore
from tandem.core.plugin_manager import PluginConfigError
from tandem.schema.config import ConfigError
from tandem.stack_file import load_config, yaml_key_lines

HEADER = "model: {model: scripted, vocab_size: 64, max_model_len: 64}\n"


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(HEADER + body)
    return path


def engine_error(path: Path) -> str:
    with pytest.raises((ConfigError, PluginConfigError)) as info:
        EngineCore(resolve_config(load_config(path)), source=str(path))
    return str(info.value)


def test_key_lines_cover_mappings_and_sequences() -> None:
    lines = yaml_key_lines("a:\n  b: 1\nplugins:\n  - name: x\n  - name: y\n    options: {k: 2}\n")
    assert lines[("a",)] == 1 and lines[("a", "b")] == 2
    assert lines[("plugins", 0)] == 4 and lines[("plugins", 1)] == 5
    assert lines[("plugins", 1, "options", "k")] == 6


def test_wrong_type_names_file_line_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, "scheduler:\n  max_num_seqs: many\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: scheduler\.max_num_seqs: "):
        load_config(path)


def test_missing_plugin_names_its_entry_line(tmp_path: Path) -> None:
    path = write(tmp_path, "plugins:\n  - name: reference-scheduler\n  - name: no-such-plugin\n")
    message = engine_error(path)
    assert message.startswith(f"{path}:4: plugins[1].name: unknown plugin 'no-such-plugin'")


def test_misspelt_option_points_at_the_file_entry_not_the_resolved_index(tmp_path: Path) -> None:
    """Under async the resolver inserts the async layer; the error still names the
    file's own index and line."""
    path = write(
        tmp_path,
        "scheduler: {async_scheduling: true}\n"
        "plugins:\n"
        "  - name: reference-scheduler\n"
        "  - name: default-sampler\n"
        "    options: {colour: red}\n",
    )
    message = engine_error(path)
    assert message.startswith(f"{path}:5: plugins[1].options: colour: unknown field")


def test_two_schedulers_name_both_plugins(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "plugins:\n  - name: reference-scheduler\n  - name: default-sampler\n"
        "  - name: reference-scheduler\n",
    )
    message = engine_error(path)
    assert str(path) in message
    assert "claim the scheduler role (reference-scheduler, reference-scheduler)" in message


def test_grammar_backend_without_a_masking_sampler_names_both(tmp_path: Path) -> None:
    """A grammar backend in a stack whose sampler cannot apply its masks is refused."""
    path = write(tmp_path, "plugins:\n  - name: reference-scheduler\n  - name: fake-grammar\n")
    message = engine_error(path)
    assert "grammar backend fake-grammar needs a sampler" in message
    assert "the stack has no sampler" in message
