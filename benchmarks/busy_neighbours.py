"""Run a command (default: `make test`) beside CPU-bound busy neighbours, as on a shared
machine, and record how it fared.

Starts `--neighbours` processes (default 2) that each spin a pure-Python loop on one CPU;
every neighbour stops by itself after `--max-neighbour-s` seconds (default: the command's
timeout plus a minute) and all of them are killed when the command ends, fails, times out
or this script is interrupted. Then runs the command in the checkout's root, with its own
output passed through, and writes to `benchmarks/results/busy_neighbours.json` (one entry
per `--label`): the command, its exit code and wall time, the load average sampled every
5 s while it ran (and its maximum), the CPU time each neighbour got, the pytest summary
lines in the output (e.g. `12 passed, 1 failed in 300.01s`), the CPU count and flags.

    python benchmarks/busy_neighbours.py                      # make test, 2 neighbours
    python benchmarks/busy_neighbours.py --label chat --command \\
        ".venv/bin/python -m pytest -q tests/server/test_e2e_chat.py"
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "busy_neighbours.json"
#: A pytest summary line: "==== 3 failed, 120 passed, 2 skipped in 301.22s (0:05:01) ====".
SUMMARY = re.compile(r"^=*\s*(\d+ \w+.* in [\d.]+s.*?)\s*=*$")
LOAD_SAMPLE_S = 5.0


def spin(max_s: float) -> None:
    """A busy neighbour: burn one CPU in pure Python until `max_s` seconds have passed."""
    end = time.monotonic() + max_s
    x = 0
    while time.monotonic() < end:
        for i in range(10_000):
            x = (x * 31 + i) % 1_000_003


def pytest_summaries(output: str) -> list[str]:
    """Every pytest summary line of `output`, in order (`make test` runs pytest three
    times: the engine's suite, then each example plugin's)."""
    found = []
    for line in output.splitlines():
        match = SUMMARY.match(line.strip())
        if match and re.search(r"\b(passed|failed|error|errors|skipped|deselected)\b", line):
            found.append(match.group(1))
    return found


def cpu_flags() -> list[str]:
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


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_command(command: str, timeout_s: float) -> tuple[int, str, float, bool]:
    """Run `command` in a shell in its own process group, echoing its output; (exit code,
    output, wall seconds, timed out). On timeout the whole group is killed."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        shell=True,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    chunks: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            chunks.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    reader.join(10)
    return proc.returncode, "".join(chunks), time.monotonic() - start, timed_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--command", default="make test", help="shell command (run in the root)")
    parser.add_argument("--neighbours", type=int, default=2, help="busy processes beside it")
    parser.add_argument("--timeout", type=float, default=3600.0, help="the command's limit (s)")
    parser.add_argument(
        "--max-neighbour-s",
        type=float,
        help="each neighbour stops by itself after this long (default: timeout + 60 s)",
    )
    parser.add_argument("--label", default="make test", help="entry name in the results")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.neighbours < 0 or args.timeout <= 0:
        parser.error("--neighbours must be >= 0 and --timeout > 0")
    max_neighbour_s = args.max_neighbour_s or args.timeout + 60.0

    load_before = os.getloadavg()
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    started = time.monotonic()

    def sample_load() -> None:
        while not stop.wait(LOAD_SAMPLE_S):
            samples.append((round(time.monotonic() - started, 1), os.getloadavg()[0]))

    context = multiprocessing.get_context("spawn")
    neighbours = [
        context.Process(target=spin, args=(max_neighbour_s,), daemon=True, name=f"busy-{i}")
        for i in range(args.neighbours)
    ]
    sampler = threading.Thread(target=sample_load, daemon=True)
    try:
        for neighbour in neighbours:
            neighbour.start()
        sampler.start()
        code, output, wall_s, timed_out = run_command(args.command, args.timeout)
        neighbour_cpu = [cpu_seconds(n.pid) for n in neighbours if n.pid is not None]
        alive_at_end = sum(n.is_alive() for n in neighbours)
    finally:
        stop.set()
        for neighbour in neighbours:
            if neighbour.is_alive():
                neighbour.kill()
            neighbour.join(10)

    loads = [load for _, load in samples]
    entry: dict[str, Any] = {
        "command": args.command,
        "exit_code": code,
        "timed_out": timed_out,
        "wall_s": round(wall_s, 1),
        "pytest_summaries": pytest_summaries(output),
        "neighbours": args.neighbours,
        "neighbour_max_s": max_neighbour_s,
        "neighbours_alive_at_end": alive_at_end,
        "neighbour_cpu_s": [None if c is None else round(c, 1) for c in neighbour_cpu],
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "load_1min_max": max(loads, default=None),
        "load_1min_samples": samples,
        "cpu_count": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[args.label] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(
        f"busy_neighbours: {args.command!r} exit {code} in {wall_s:.0f} s beside "
        f"{args.neighbours} busy processes (load max {entry['load_1min_max']}); "
        f"summaries: {entry['pytest_summaries']}; wrote {args.out}",
        file=sys.stderr,
    )
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
