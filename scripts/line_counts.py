"""Line counts of the tree against its size limits; prints them and writes JSON.

- kernel: exactly `cat core/*.py | wc -l` (newlines in core/*.py, core/worker/ excluded),
  limit 1,900 (1,500 until issue 24 added plugin-failure attribution, `plugin_error.py`,
  to the plugin manager, 1,825 until issue 27 added the engine's one clock, `clock.py`,
  and the `step_cost` hookspec; resolution-time checks live in the front door,
  `stack_checks.py`);
- files: the 10 largest .py files outside tests (no directory named `tests` in the path;
  virtual environments, build outputs and hidden directories skipped), limit 400 lines;
- functions: the 10 longest functions in core/, plugins/ and kv/ (ast: from the `def` line
  to the last line, nested functions counted on their own too), limit 80 lines.

`--check LIMITS` (comma list of kernel, files, functions; default all) exits 1 when one of
those limits is broken, naming every offender; `--files-under DIRS` limits the files check
to those top-level directories. Without `--check` it only reports.

    python scripts/line_counts.py                    # writes benchmarks/results/line_counts.json
    python scripts/line_counts.py --check functions,files --files-under core,kv,plugins
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "line_counts.json"
#: kernel: 1750 until the kernel took executors by name with `collective_rpc` and the
#: entry-point scan (issue 25: +~50 lines; the bottom layers no longer reach the front door).
LIMITS = {"kernel": 1900, "files": 400, "functions": 80}
FUNCTION_DIRS = ("core", "plugins", "kv")
SKIP_DIRS = {"tests", "build", "dist", "node_modules", "__pycache__"}
TOP = 10


def lines(path: Path) -> int:
    """Lines as `wc -l` counts them: newline characters."""
    return path.read_bytes().count(b"\n")


def source_files(root: Path) -> list[Path]:
    """Every .py file outside tests, environments, build outputs and hidden directories."""
    found = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts[:-1]
        if any(p in SKIP_DIRS or p.startswith(".") or p.endswith(".egg-info") for p in parts):
            continue
        found.append(path)
    return sorted(found)


def functions(path: Path, root: Path) -> list[tuple[int, str]]:
    """(lines, "path:line qualname") of every function in `path`, nested ones included."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                size = (child.end_lineno or child.lineno) - child.lineno + 1
                found.append((size, f"{path.relative_to(root)}:{child.lineno} {name}"))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return found


def measure(root: Path, files_under: tuple[str, ...] | None = None) -> dict:
    kernel = sum(lines(p) for p in sorted((root / "core").glob("*.py")))
    files = [(lines(p), str(p.relative_to(root))) for p in source_files(root)]
    checked_files = [
        (n, name) for n, name in files if files_under is None or name.split("/")[0] in files_under
    ]
    funcs = [
        entry
        for d in FUNCTION_DIRS
        for p in sorted((root / d).rglob("*.py"))
        if "tests" not in p.relative_to(root).parts
        for entry in functions(p, root)
    ]
    largest = sorted(files, key=lambda f: (-f[0], f[1]))[:TOP]
    longest = sorted(funcs, key=lambda f: (-f[0], f[1]))[:TOP]
    return {
        "kernel": {"lines": kernel, "limit": LIMITS["kernel"], "command": "cat core/*.py | wc -l"},
        "largest_files": [{"path": name, "lines": n} for n, name in largest],
        "files_over_limit": [
            {"path": name, "lines": n} for n, name in checked_files if n > LIMITS["files"]
        ],
        "file_limit": LIMITS["files"],
        "files_checked_under": list(files_under) if files_under else "all outside tests",
        "longest_functions": [{"function": name, "lines": n} for n, name in longest],
        "functions_over_limit": [
            {"function": name, "lines": n} for n, name in funcs if n > LIMITS["functions"]
        ],
        "function_limit": LIMITS["functions"],
        "function_dirs": list(FUNCTION_DIRS),
    }


def broken(report: dict, checks: set[str]) -> list[str]:
    problems = []
    if "kernel" in checks and report["kernel"]["lines"] > LIMITS["kernel"]:
        problems.append(f"kernel: {report['kernel']['lines']} lines > {LIMITS['kernel']}")
    if "files" in checks:
        problems += [
            f"file over {LIMITS['files']} lines: {f['path']} ({f['lines']})"
            for f in report["files_over_limit"]
        ]
    if "functions" in checks:
        problems += [
            f"function over {LIMITS['functions']} lines: {f['function']} ({f['lines']})"
            for f in report["functions_over_limit"]
        ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree to measure")
    parser.add_argument("--json", type=Path, default=OUT, help="where to write the JSON")
    parser.add_argument("--no-json", action="store_true", help="print only")
    parser.add_argument(
        "--check", nargs="?", const=",".join(LIMITS), help="comma list of limits to enforce"
    )
    parser.add_argument("--files-under", help="comma list of top-level dirs for the files check")
    args = parser.parse_args(argv)
    checks = set(args.check.split(",")) if args.check else set()
    if checks - set(LIMITS):
        parser.error(
            f"--check: unknown limit(s) {sorted(checks - set(LIMITS))}; use {list(LIMITS)}"
        )
    under = tuple(args.files_under.split(",")) if args.files_under else None
    report = measure(args.root.resolve(), under)
    print(f"kernel (cat core/*.py | wc -l): {report['kernel']['lines']} (limit {LIMITS['kernel']})")
    print(f"largest files (limit {LIMITS['files']}):")
    for f in report["largest_files"]:
        print(f"  {f['lines']:5d}  {f['path']}")
    print(f"longest functions in {', '.join(FUNCTION_DIRS)} (limit {LIMITS['functions']}):")
    for f in report["longest_functions"]:
        print(f"  {f['lines']:5d}  {f['function']}")
    if not args.no_json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    problems = broken(report, checks)
    for problem in problems:
        print(f"LIMIT BROKEN: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
