"""The commands that only read configuration import only what they use: `tandem plugins
list` and `tandem config show` load no transformers (no model is built), resolving a
config's threads loads no torch, and the model loader sizes the KV pool without importing
the model modules. Each check runs in a fresh interpreter and reads `sys.modules`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WATCHED = ("torch", "transformers", "tandem.models.paged_attention")


def _loaded_after(code: str) -> list[str]:
    """Which of WATCHED a fresh interpreter has imported after running `code`."""
    probe = (
        "import contextlib, io, json, sys\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        + "".join(f"    {line}\n" for line in code.splitlines())
        + f"print(json.dumps(sorted(m for m in {WATCHED!r} if m in sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plugins_list_loads_no_transformers() -> None:
    loaded = _loaded_after("from tandem.cli import main\nassert main(['plugins', 'list']) == 0")
    assert "transformers" not in loaded and "tandem.models.paged_attention" not in loaded


def test_config_show_of_a_scripted_stack_loads_no_transformers(tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text("model:\n  model: scripted\n")
    loaded = _loaded_after(
        f"from tandem.cli import main\nassert main(['config', 'show', {str(stack)!r}]) == 0"
    )
    assert "transformers" not in loaded and "tandem.models.paged_attention" not in loaded


def test_config_resolution_and_thread_checks_load_no_torch() -> None:
    code = (
        "import tandem.config_resolution\n"
        "from tandem.schema.config import EngineConfig\n"
        "from tandem.core.worker.threads import resolve_worker_threads\n"
        "config = EngineConfig()\n"
        "config.parallel.cpu_bind = 'auto'\n"
        "resolve_worker_threads(config)"
    )
    assert _loaded_after(code) == []


def test_kv_pool_sizing_of_an_hf_model_loads_no_model_modules(tiny_llama_dir: Path) -> None:
    code = (
        "from tandem.schema.config import EngineConfig\n"
        "from tandem.models.hf_loader import HFModelLoader\n"
        f"config = EngineConfig(model={{'model': {str(tiny_llama_dir)!r}}})\n"
        "HFModelLoader.resolve_limits(config)\n"
        "assert config.cache.num_kv_blocks and config.cache.num_kv_blocks > 0"
    )
    assert "tandem.models.paged_attention" not in _loaded_after(code)
