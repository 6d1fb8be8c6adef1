"""Invalid options are rejected with an error naming the option (and the stack file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tandem import load_config
from tandem.config_resolution import resolve_config
from tandem.core.plugin_manager import PluginConfigError
from tandem.testing import make_scripted_engine

from _helpers import STACK, lrw_stack
from tandem_lrw import LRWOptions


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "greater than or equal to 1"),
        (-2, "greater than or equal to 1"),
        ("2", "valid integer"),  # strict: no silent string coercion
        (True, "valid integer"),
        (1.5, "valid integer"),
    ],
)
def test_bad_max_preemptions_names_the_option(value: Any, message: str) -> None:
    with pytest.raises(PluginConfigError) as info:
        make_scripted_engine(plugins=lrw_stack(value))
    text = str(info.value)
    assert "plugins[1].options: max_preemptions:" in text
    assert message in text
    assert repr(value) in text


def test_unknown_option_is_rejected() -> None:
    stack = ["reference-scheduler", {"name": "lrw-victim", "options": {"max": 1}}]
    with pytest.raises(PluginConfigError, match=r"plugins\[1\]\.options: max: unknown field"):
        make_scripted_engine(plugins=stack)


def test_bad_option_in_a_yaml_stack_names_the_file(tmp_path: Path) -> None:
    stack = tmp_path / "bad.yaml"
    stack.write_text(STACK.read_text().replace("max_preemptions: 2", "max_preemptions: 0"))
    with pytest.raises(PluginConfigError) as info:  # options are checked as the stack resolves
        resolve_config(load_config(stack))
    line = 1 + stack.read_text().splitlines().index("  - name: lrw-victim")
    assert str(info.value).startswith(f"{stack}:{line}: plugins[1].options: max_preemptions: ")


def test_default_is_accepted() -> None:
    assert LRWOptions().max_preemptions == 2
    make_scripted_engine(plugins=lrw_stack()).shutdown()
