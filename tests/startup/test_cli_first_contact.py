"""The CLI's first impression: `tandem --help` and `import tandem` load nothing heavy, a
plugin that exits at import is listed as broken, `tandem trace` and `tandem bench` write
into the current directory (never into the checkout) and say where."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tandem.bench as bench
from tandem.cli import main as cli_main
from tandem.trace import main as trace_main

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "numpy")


def _modules_after(code: str) -> list[str]:
    probe = f"import sys\n{code}\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_import_tandem_loads_no_torch() -> None:
    assert _modules_after("import tandem") == []


def test_help_loads_no_torch() -> None:
    code = (
        "from tandem.cli import main\n"
        "for argv in (['--help'], ['generate', '--help'], ['bench', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass"
    )
    assert _modules_after(code) == []


def test_public_names_still_import() -> None:
    import tandem
    from tandem import LLM, SamplingParams

    assert LLM.__name__ == "LLM" and SamplingParams.__name__ == "SamplingParams"
    assert set(tandem.__all__) <= set(dir(tandem))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = tandem.nope


# A plugin that calls sys.exit at import --------------------------------------------------
def _install_exiting_plugin(root: Path) -> None:
    (root / "exiting_plugin.py").write_text("import sys\nsys.exit(3)\n")
    info = root / "exiting_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: exiting-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[tandem.plugins]\nexiting-plugin = exiting_plugin:Plugin\n"
    )


def test_plugin_calling_sys_exit_is_reported_as_broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.core.plugin_manager import PluginConfigError
    from tandem.plugin_discovery import load_plugin_class

    _install_exiting_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginConfigError, match=r"'exiting-plugin'.*sys\.exit\(3\)"):
        load_plugin_class("exiting-plugin")
    assert cli_main(["plugins", "list"]) == 0
    out, err = capsys.readouterr()
    assert "exiting-plugin  (exiting-plugin 1.0)" in out
    assert "ERROR: plugins: plugin 'exiting-plugin'" in out and "sys.exit(3)" in out
    assert "reference-scheduler" in out and "default-sampler" in out  # the others still listed
    # Other tests of the session may have installed broken plugins of their own.
    assert re.search(r"broken plugin\(s\), not usable: (.*, )?exiting-plugin\b", err)


def test_keyboard_interrupt_in_a_plugin_import_still_interrupts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.plugin_discovery import load_plugin_class

    _install_exiting_plugin(tmp_path)
    (tmp_path / "exiting_plugin.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        load_plugin_class("exiting-plugin")


# Where trace and bench write -------------------------------------------------------------
def test_trace_writes_into_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli_main(["trace", "--requests", "4", "--prompt", "4", "--output", "2"]) == 0
    for suffix in (".json", ".png", ".stats.json"):
        assert (tmp_path / f"tandem-trace{suffix}").exists(), suffix
    assert f"wrote {tmp_path / 'tandem-trace.json'}" in capsys.readouterr().err


def test_trace_without_matplotlib_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert trace_main(["--requests", "2", "--prompt", "4", "--output", "2"]) == 2
    assert "pip install 'tandem[trace]'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # refused before recording anything
    assert trace_main(["--no-png", "--requests", "2", "--prompt", "4", "--output", "2"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "tandem-trace.json",
        "tandem-trace.stats.json",
    ]


def test_bench_writes_into_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The peers are stubbed: this checks where the results go and what the peers read."""
    seen: list[dict[str, Any]] = []

    def fake_spawn(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
        workload = json.loads(Path(cmd[cmd.index("--workload") + 1]).read_text())
        seen.append(workload)
        return {"output_tokens_per_s": 1.0, "ttft_median_s": 0.1, "tpot_median_s": 0.01}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "_spawn", fake_spawn)
    results = ROOT / "benchmarks" / "results"
    before = {p: p.stat().st_mtime_ns for p in results.glob("*.json")}
    assert cli_main(["bench", "latency", "--peers", "tandem"]) == 0
    out = tmp_path / "tandem-bench-latency.json"
    assert json.loads(out.read_text())["workload"] == "latency"
    assert f"wrote {out}" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in results.glob("*.json")} == before
    checkout = json.loads((ROOT / "benchmarks" / "workloads" / "latency.json").read_text())
    assert seen == [checkout]  # the built-in workload is the checkout's, token for token


@pytest.mark.parametrize("name", ["default", "latency", "small"])
def test_builtin_workloads_equal_the_checkout_files(name: str) -> None:
    checkout = json.loads((ROOT / "benchmarks" / "workloads" / f"{name}.json").read_text())
    assert bench.load_workload(name) == checkout


def test_dtype_and_quantization_flags_are_the_schemas_values() -> None:
    """`--dtype` / `--quantization` offer exactly `model.dtype` / `model.quantization`'s
    values and reach the engine's keywords; a wrong value is refused naming the flag."""
    from typing import get_args

    from tandem.cli import DTYPES, QUANTIZATIONS, _overrides, build_parser
    from tandem.schema.config import ModelConfig

    assert get_args(ModelConfig.model_fields["dtype"].annotation) == DTYPES
    assert get_args(ModelConfig.model_fields["quantization"].annotation) == QUANTIZATIONS
    args = build_parser().parse_args(["serve", "--dtype", "bfloat16", "-q", "none"])
    assert _overrides(args).items() >= {"dtype": "bfloat16", "quantization": "none"}.items()
    assert "dtype" not in _overrides(build_parser().parse_args(["serve"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "fp8"])
