"""`scripts/line_counts.py`: the tree keeps its size limits (no function over 80 lines in
core/, plugins/, kv/; no file over 400 lines there), and the script measures what it says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "line_counts.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT
    )


def test_kernel_limit_and_no_long_function_or_large_file_in_core_plugins_kv(
    tmp_path: Path,
) -> None:
    out = tmp_path / "counts.json"
    checks = "kernel,functions,files"
    done = run("--check", checks, "--files-under", "core,kv,plugins", "--json", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["functions_over_limit"] == [] and report["files_over_limit"] == []


def test_kernel_count_is_cat_core_wc_l(tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    assert run("--json", str(out)).returncode == 0  # no --check: reports only
    wc = subprocess.run(
        "cat core/*.py | wc -l", shell=True, capture_output=True, text=True, cwd=ROOT
    )
    assert json.loads(out.read_text())["kernel"]["lines"] == int(wc.stdout)


def test_limits_are_found_in_a_small_tree(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "core").mkdir(parents=True)
    (tree / "plugins" / "tests").mkdir(parents=True)
    (tree / "core" / "small.py").write_text("x = 1\ny = 2")  # no final newline: 1 line
    body = "".join(f"        a{i} = {i}\n" for i in range(85))
    (tree / "plugins" / "long.py").write_text(
        f"class P:\n    def outer(self):\n        def inner():\n{body.replace('        ', '            ')}"
        f"            return 0\n        return inner\n"
    )
    (tree / "plugins" / "tests" / "test_big.py").write_text("x = 1\n" * 500)  # not counted
    out = tmp_path / "counts.json"
    done = run("--root", str(tree), "--json", str(out), "--check", "functions")
    assert done.returncode == 1 and "P.outer.inner" in done.stderr
    report = json.loads(out.read_text())
    assert report["kernel"]["lines"] == 1
    longest = {f["function"]: f["lines"] for f in report["longest_functions"]}
    assert longest == {"plugins/long.py:2 P.outer": 89, "plugins/long.py:3 P.outer.inner": 87}
    assert [f["path"] for f in report["largest_files"]] == ["plugins/long.py", "core/small.py"]
    assert run("--root", str(tree), "--no-json", "--check", "files").returncode == 0
