"""Invalid options are rejected with an error naming the option (and the stack file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tandem import load_config
from tandem.config_resolution import resolve_config
from tandem.core.plugin_manager import PluginConfigError
from tandem.testing import make_scripted_engine

from _helpers import STACK, srpt_stack
from tandem_srpt.order import SRPTOptions


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "greater than 0"),
        (0.0, "greater than 0"),
        (-3.5, "greater than 0"),
        ("fast", "valid number"),
        ("64", "valid number"),  # strict: no silent string coercion
        (True, "valid number"),
        (float("inf"), "finite number"),
    ],
)
def test_bad_aging_rate_names_the_option(value: Any, message: str) -> None:
    with pytest.raises(PluginConfigError) as info:
        make_scripted_engine(plugins=srpt_stack(value))
    text = str(info.value)
    assert "plugins[1].options: aging_rate:" in text
    assert message in text
    assert repr(value) in text


def test_unknown_option_is_rejected() -> None:
    stack = ["reference-scheduler", {"name": "srpt-order", "options": {"aging": 1.0}}]
    with pytest.raises(PluginConfigError, match=r"plugins\[1\]\.options: aging: unknown field"):
        make_scripted_engine(plugins=stack)


def test_bad_option_in_a_yaml_stack_names_the_file(tmp_path: Path) -> None:
    stack = tmp_path / "bad.yaml"
    stack.write_text(STACK.read_text().replace("aging_rate: 16.0", "aging_rate: 0"))
    with pytest.raises(PluginConfigError) as info:  # options are checked as the stack resolves
        resolve_config(load_config(stack))
    # `file:line:` of the plugin's entry in the stack, then the key path.
    line = 1 + stack.read_text().splitlines().index("  - name: srpt-order")
    assert str(info.value).startswith(f"{stack}:{line}: plugins[1].options: aging_rate: ")
    assert "greater than 0" in str(info.value)


def test_integer_rate_and_default_are_accepted() -> None:
    assert SRPTOptions().aging_rate == 64.0
    assert SRPTOptions.model_validate({"aging_rate": 8}).aging_rate == 8.0
    engine = make_scripted_engine(plugins=srpt_stack(1e-3))
    engine.shutdown()


def test_priority_policy_is_rejected_naming_the_field() -> None:
    with pytest.raises(PluginConfigError, match=r"scheduler\.scheduling_policy: .*'priority'"):
        make_scripted_engine(plugins=srpt_stack(), scheduling_policy="priority")
