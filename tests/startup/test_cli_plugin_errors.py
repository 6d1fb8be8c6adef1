"""The command line reports a plugin author's mistakes and exits non-zero: `tandem generate`
when a plugin's hook stopped the engine (exit 1, the message names the plugin, the hook
and the step; no output line is printed as if it had succeeded), `tandem config show` when
a hookimpl's signature does not match its hookspec (exit 2, naming its `file:line`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tandem.cli import main

PLUGINS = """
from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin


class RaisingVictim(TandemPlugin):
    @hookimpl
    def select_preemption_victim(self, running, needed_by):
        raise ZeroDivisionError("victim rule divided by zero")


class MisnamedArgument(TandemPlugin):
    @hookimpl
    def select_preemption_victim(self, running, needed):
        return running[-1]
"""

STACK = """
model: {{model: scripted, max_model_len: 32}}
scheduler: {{max_num_batched_tokens: 64, async_scheduling: false}}
cache: {{block_size: 4, num_kv_blocks: 8}}
plugins:
  - reference-scheduler
  - name: {module}:{plugin}
  - default-sampler
"""


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    module = f"cli_error_plugins_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PLUGINS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


def _stack(tmp_path: Path, module: str, plugin: str) -> Path:
    path = tmp_path / "stack.yaml"
    path.write_text(STACK.format(module=module, plugin=plugin))
    return path


def test_generate_exits_non_zero_naming_the_plugin_that_stopped_the_engine(
    tmp_path: Path, plugin_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = _stack(tmp_path, plugin_module, "RaisingVictim")
    prompts = [" ".join([str(2 + i)] * 8) for i in range(4)]
    rc = main(["generate", "--config", str(stack), "--token-ids", "--max-tokens", "20", *prompts])
    captured = capsys.readouterr()
    assert rc == 1
    assert "RaisingVictim' failed in hook select_preemption_victim" in captured.err
    assert "engine step" in captured.err and "ZeroDivisionError" in captured.err
    assert '"finish_reason"' not in captured.out


def test_config_show_refuses_a_misnamed_hook_argument_with_file_and_line(
    tmp_path: Path, plugin_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = _stack(tmp_path, plugin_module, "MisnamedArgument")
    rc = main(["config", "show", str(stack)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{stack}:7: plugins[1]" in err
    assert (
        f"{tmp_path / plugin_module}.py:13" in err
    )  # where the hookimpl is defined (its decorator)
    assert "select_preemption_victim" in err and "needed" in err
