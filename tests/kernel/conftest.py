"""Installs a throwaway distribution with test plugins under the `tandem.plugins` entry
point group, so the plugin manager discovers them exactly as it would a pip install."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PLUGIN_MODULE = """
from pydantic import BaseModel, ConfigDict
from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin

CALLS = []


class Observer(TandemPlugin):
    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        label: str = "observer"
        weight: int = 1

    @hookimpl
    def update_after_schedule(self, scheduler_output):
        state = None
        for rid in scheduler_output.num_scheduled_tokens:
            state = rid
        CALLS.append((self.options.label, scheduler_output.step_id, state))


class UnknownHook(TandemPlugin):
    @hookimpl
    def not_a_tandem_hook(self):
        return 1


class WrongSignature(TandemPlugin):
    @hookimpl
    def schedule(self, budget):
        return None
"""


@pytest.fixture(scope="session")
def test_plugins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    root: Path = tmp_path_factory.mktemp("plugins")
    (root / "tandem_test_plugins.py").write_text(PLUGIN_MODULE)
    (root / "tandem_test_plugins.py.broken").write_text("")
    (root / "tandem_broken_plugin.py").write_text("raise ImportError('missing dependency foo')\n")
    info = root / "tandem_test_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tandem-test-plugins\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[tandem.plugins]\n"
        "observer = tandem_test_plugins:Observer\n"
        "unknown-hook = tandem_test_plugins:UnknownHook\n"
        "wrong-signature = tandem_test_plugins:WrongSignature\n"
        "broken = tandem_broken_plugin:Broken\n"
    )
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    module = importlib.import_module("tandem_test_plugins")
    yield module
    sys.path.remove(str(root))
