"""Wall time of `tandem plugins list`, `tandem config show` (and `tandem --help` as the floor),
cold and warm, with the heaviest imports of each (`python -X importtime`).

Cold: the first run with an empty bytecode cache (`PYTHONPYCACHEPREFIX` pointing at a fresh
directory, so every module, torch's and transformers' included, is compiled again); the
operating system's file cache is not dropped (that would need root and disturb every
other process on the machine). Warm: later runs with that cache filled. Each figure is the
median of `--repeats` runs; the load average before and after and the CPU flags that
matter are recorded beside them. Results are appended under `--label` (e.g. `before`,
`after`) to `benchmarks/results/cli_startup.json`:

    python benchmarks/cli_startup.py --label before --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "cli_startup.json"
COMMANDS: dict[str, list[str]] = {
    "help": ["--help"],
    "plugins list": ["plugins", "list"],
    "config show": ["config", "show"],
}


def _env(pycache: str) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPYCACHEPREFIX=pycache,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )


def _run(args: list[str], pycache: str, importtime: bool = False) -> tuple[float, str]:
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "tandem.cli"]
    start = time.perf_counter()
    proc = subprocess.run(cmd + args, env=_env(pycache), capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"tandem {' '.join(args)} failed: {proc.stderr[-2000:]}")
    return elapsed, proc.stderr


def _heaviest(importtime_log: str, top: int) -> list[dict[str, Any]]:
    """The `top` modules with the largest cumulative import time (the lines
    `import time: self [us] | cumulative | name`)."""
    rows = []
    for line in importtime_log.splitlines():
        parts = line.split("|")
        if not line.startswith("import time:") or len(parts) != 3 or "cumulative" in line:
            continue
        rows.append((int(parts[1]), parts[2].strip()))
    rows.sort(reverse=True)
    return [{"module": name, "cumulative_s": round(us / 1e6, 3)} for us, name in rows[:top]]


def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return sorted(
        f for f in flags if f in {"avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}
    )


def measure(repeats: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for name, args in COMMANDS.items():
        cold = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="tandem-pycache-") as pycache:
                cold.append(_run(args, pycache)[0])
        with tempfile.TemporaryDirectory(prefix="tandem-pycache-") as pycache:
            _run(args, pycache)  # fill the bytecode cache
            warm = [_run(args, pycache)[0] for _ in range(repeats)]
            _, log = _run(args, pycache, importtime=True)
        figures[name] = {
            "cold_median_s": round(statistics.median(cold), 3),
            "warm_median_s": round(statistics.median(warm), 3),
            "cold_s": [round(t, 3) for t in cold],
            "warm_s": [round(t, 3) for t in warm],
            "heaviest_imports_warm": _heaviest(log, 8),
        }
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", required=True, help="name of this measurement (before, after)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    figures = measure(args.repeats)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[args.label] = {
        "commands": figures,
        "repeats": args.repeats,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": _cpu_flags(),
        "python": sys.version.split()[0],
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for name, fig in figures.items():
        print(f"{name:14s} cold {fig['cold_median_s']:.2f} s  warm {fig['warm_median_s']:.2f} s")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
