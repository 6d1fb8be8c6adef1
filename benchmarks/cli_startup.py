"""Wall time of `tandem plugins list`, `tandem config show` (and `tandem --help` as the
floor), and from `tandem serve` to `/health` 200, cold and warm, with the heaviest imports of
each command and where a server's startup goes.

Three modes, each figure the median of `--repeats` runs:
- cold: an empty bytecode cache (`PYTHONPYCACHEPREFIX` pointing at a fresh directory, so
  every module, torch's and transformers' included, is compiled again);
- warm: the same after one run filled that cache (bytecode writing is switched on for
  these runs whatever `PYTHONDONTWRITEBYTECODE` says: with it set, no run is ever warm);
- installed: the environment as it is (no prefix: site-packages' own bytecode, tandem's
  written or not as `PYTHONDONTWRITEBYTECODE` says), what `make test` and a user see.
The operating system's file cache is not dropped (that would need root and disturb every
other process on the machine). The load average and the CPU flags that matter are
recorded beside the figures.

Serve: `tandem serve MODEL --host 127.0.0.1 --worker-threads 1` for `scripted` and for a
tiny random Llama with a word-level tokenizer (`tandem.testing.tiny_model`), timed until
`/health` answers 200, then stopped. Each server runs with a tracer (a `sitecustomize`
written for the run) that stamps the phases: the API process's imports, its config
resolution, the engine core's imports after the spawn, its build up to the model load, the
model load, and the rest until healthy. Phase figures are medians over the warm runs.

`--baseline LABEL=DIR` measures a second checkout (e.g. `git worktree add DIR HEAD` or
`git archive HEAD | tar -x -C DIR`) in the same virtual environment, each of its runs right
after the same run of the working tree, so both see the same load; the ratios
(working tree / baseline) are written too. Results are stored under their labels in
`benchmarks/results/cli_startup.json`:

    python benchmarks/cli_startup.py --label after --baseline before-rerun=/tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "cli_startup.json"
COMMANDS: dict[str, list[str]] = {
    "help": ["--help"],
    "plugins list": ["plugins", "list"],
    "config show": ["config", "show"],
}
SERVE_TIMEOUT_S = 900.0

#: Written as `sitecustomize.py` for every run: remaps the editable install to another
#: checkout (TANDEM_BENCH_SOURCE_ROOT) and, with TANDEM_BENCH_TRACE=1, prints one
#: `TANDEM_PHASE <pid> <unix time> <event>` line per phase boundary on stderr.
SITECUSTOMIZE = r"""
import functools, importlib.abc, importlib.util, os, sys, time

_root = os.environ.get("TANDEM_BENCH_SOURCE_ROOT")
_finder = next(
    (m for n, m in list(sys.modules.items()) if n.startswith("__editable___tandem_")), None
)
if _root and _finder is not None:
    for _key, _path in list(_finder.MAPPING.items()):
        _finder.MAPPING[_key] = _path.replace(os.environ["TANDEM_BENCH_WORK_ROOT"], _root)


def _stamp(event):
    print(f"TANDEM_PHASE {os.getpid()} {time.time():.4f} {event}", file=sys.stderr, flush=True)


_WRAP = {
    "tandem.engine.async_llm": ["AsyncLLM.__init__"],
    "tandem.config_resolution": ["resolve_config"],
    "tandem.engine.core_proc": ["run_engine_core"],
    "tandem.core.engine_core": ["EngineCore.__init__"],
    "tandem.core.worker.model_loader": ["load_step_model"],
}


def _wrap(module, path):
    owner, _, name = path.rpartition(".")
    holder = getattr(module, owner) if owner else module
    fn = getattr(holder, name, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        _stamp(f"{module.__name__}.{path} begin")
        try:
            return fn(*args, **kwargs)
        finally:
            _stamp(f"{module.__name__}.{path} end")

    setattr(holder, name, traced)


class _Tracer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _WRAP:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def traced_exec(module):
            exec_module(module)
            for path in _WRAP[name]:
                _wrap(module, path)

        spec.loader.exec_module = traced_exec
        return spec


if os.environ.get("TANDEM_BENCH_TRACE") == "1":
    with open(f"/proc/{os.getpid()}/stat") as _f:
        _start_ticks = int(_f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as _f:
        _uptime = float(_f.read().split()[0])
    _started = time.time() - (_uptime - _start_ticks / os.sysconf("SC_CLK_TCK"))
    print(f"TANDEM_PHASE {os.getpid()} {_started:.4f} process start", file=sys.stderr)
    sys.meta_path.insert(0, _Tracer())
"""


class Tree:
    """One checkout to measure: the working tree (no remap) or another one."""

    def __init__(self, label: str, source_root: Path | None, site_dir: Path) -> None:
        self.label = label
        self.source_root = source_root
        self.site_dir = site_dir

    def env(self, pycache: str | None, trace: bool = False) -> dict[str, str]:
        """The run's environment; `pycache` None: the bytecode settings as they are."""
        env = dict(os.environ)
        if pycache is not None:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = pycache
        env.update(
            PYTHONPATH=os.pathsep.join([str(self.site_dir), env.get("PYTHONPATH", "")]),
            TANDEM_BENCH_WORK_ROOT=str(ROOT),
            TANDEM_BENCH_TRACE="1" if trace else "0",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
        )
        if self.source_root is not None:
            env["TANDEM_BENCH_SOURCE_ROOT"] = str(self.source_root)
        return env


def _run_cli(tree: Tree, args: list[str], pycache: str | None, importtime: bool = False) -> tuple:
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "tandem.cli"]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd + args, env=tree.env(pycache), capture_output=True, text=True, cwd=tempfile.gettempdir()
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"tandem {' '.join(args)} failed: {proc.stderr[-2000:]}")
    return elapsed, proc.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _run_serve(tree: Tree, model: str, pycache: str | None) -> tuple[float, dict[str, float]]:
    """Seconds from launching `tandem serve` to /health 200, and its phases (seconds)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--worker-threads", "1"]
    with tempfile.TemporaryFile("w+") as log:
        start = time.time()
        proc = subprocess.Popen(
            cmd,
            env=tree.env(pycache, trace=True),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tempfile.gettempdir(),
        )
        try:
            while not _healthy(port):
                if proc.poll() is not None or time.time() - start > SERVE_TIMEOUT_S:
                    log.seek(0)
                    raise RuntimeError(f"tandem serve {model} did not start: {log.read()[-3000:]}")
                time.sleep(0.05)
            healthy = time.time()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.seek(0)
        return healthy - start, _phases(log.read(), start, healthy)


def _phases(log: str, launched: float, healthy: float) -> dict[str, float]:
    """Phase durations from the tracer's stamps: the API process is the first process,
    the engine core the process that ran `run_engine_core`."""
    stamps: dict[str, dict[str, float]] = {}
    for line in log.splitlines():
        if line.startswith("TANDEM_PHASE "):
            _, pid, when, event = line.split(" ", 3)
            stamps.setdefault(pid, {}).setdefault(event, float(when))
    api = next((s for s in stamps.values() if "process start" in s), {})
    core = next(
        (s for s in stamps.values() if "tandem.engine.core_proc.run_engine_core begin" in s), {}
    )

    def span(a: dict[str, float], first: str, b: dict[str, float], last: str) -> float | None:
        return round(b[last] - a[first], 3) if first in a and last in b else None

    launch = {"launch": launched}
    done = {"healthy": healthy}
    engine_built = "tandem.core.engine_core.EngineCore.__init__ end"
    return {
        name: value
        for name, value in {
            "api_interpreter_and_imports": span(
                launch, "launch", api, "tandem.engine.async_llm.AsyncLLM.__init__ begin"
            ),
            "api_resolve_config": span(
                api,
                "tandem.config_resolution.resolve_config begin",
                api,
                "tandem.config_resolution.resolve_config end",
            ),
            "api_resolved_to_engine_core_spawned": span(
                api, "tandem.config_resolution.resolve_config end", core, "process start"
            ),
            "engine_core_interpreter_and_imports": span(
                core, "process start", core, "tandem.engine.core_proc.run_engine_core begin"
            ),
            "engine_core_build_before_model": span(
                core,
                "tandem.engine.core_proc.run_engine_core begin",
                core,
                "tandem.core.worker.model_loader.load_step_model begin",
            ),
            "model_load": span(
                core,
                "tandem.core.worker.model_loader.load_step_model begin",
                core,
                "tandem.core.worker.model_loader.load_step_model end",
            ),
            "engine_core_after_model": span(
                core, "tandem.core.worker.model_loader.load_step_model end", core, engine_built
            ),
            "ready_to_healthy": span(core, engine_built, done, "healthy"),
        }.items()
        if value is not None
    }


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


MODES = ("cold", "warm", "installed")


def _interleaved(
    trees: list[Tree], repeats: int, modes: list[str], run: Callable[[Tree, str | None], Any]
) -> dict[str, dict[str, list[Any]]]:
    """`repeats` runs of `run(tree, pycache)` per mode and tree, each tree's run right after
    the other trees' same run (so they see the same load). Warm runs share one cache per
    tree, filled by one run first. Returns {label: {mode: [result, ...]}}."""
    out: dict[str, dict[str, list[Any]]] = {t.label: {m: [] for m in modes} for t in trees}
    caches = {t.label: tempfile.TemporaryDirectory(prefix="tandem-pycache-") for t in trees}
    try:
        if "warm" in modes:
            for tree in trees:
                run(tree, caches[tree.label].name)  # fill the bytecode cache
        for mode in modes:
            for _ in range(repeats):
                for tree in trees:
                    if mode == "cold":
                        with tempfile.TemporaryDirectory(prefix="tandem-pycache-") as fresh:
                            out[tree.label][mode].append(run(tree, fresh))
                    else:
                        cache = caches[tree.label].name if mode == "warm" else None
                        out[tree.label][mode].append(run(tree, cache))
        return out
    finally:
        for cache in caches.values():
            cache.cleanup()


def _summary(runs: dict[str, list[float]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode, times in runs.items():
        summary[f"{mode}_median_s"] = round(statistics.median(times), 3)
        summary[f"{mode}_s"] = [round(t, 3) for t in times]
    return summary


def measure_cli(trees: list[Tree], repeats: int, modes: list[str]) -> dict[str, dict]:
    figures: dict[str, dict[str, Any]] = {t.label: {} for t in trees}
    for name, args in COMMANDS.items():

        def run(tree: Tree, pycache: str | None, args: list[str] = args) -> float:
            return _run_cli(tree, args, pycache)[0]

        runs = _interleaved(trees, repeats, modes, run)
        for tree in trees:
            with tempfile.TemporaryDirectory(prefix="tandem-pycache-") as pycache:
                _run_cli(tree, args, pycache)
                log = _run_cli(tree, args, pycache, importtime=True)[1]
            figures[tree.label][name] = {
                **_summary(runs[tree.label]),
                "heaviest_imports_warm": _heaviest(log, 8),
                "load_average_after": os.getloadavg(),
            }
        print(_line(name, figures, trees, modes), flush=True)
    return figures


def measure_serve(
    trees: list[Tree], repeats: int, modes: list[str], models: dict[str, str]
) -> dict[str, dict]:
    figures: dict[str, dict[str, Any]] = {t.label: {} for t in trees}
    for name, model in models.items():

        def run(tree: Tree, pycache: str | None, model: str = model) -> tuple[float, dict]:
            return _run_serve(tree, model, pycache)

        runs = _interleaved(trees, repeats, modes, run)
        key = f"serve {name} to healthy"
        for tree in trees:
            mine = runs[tree.label]
            figure: dict[str, Any] = _summary({m: [t for t, _ in mine[m]] for m in modes})
            for mode in modes:
                phase_runs = [p for _, p in mine[mode]]
                figure[f"{mode}_phases_median_s"] = {
                    phase: round(statistics.median(p[phase] for p in phase_runs if phase in p), 3)
                    for phase in phase_runs[0]
                }
            figure["load_average_after"] = os.getloadavg()
            figures[tree.label][key] = figure
        print(_line(key, figures, trees, modes), flush=True)
    return figures


def _line(name: str, figures: dict, trees: list[Tree], modes: list[str]) -> str:
    parts = [
        f"{t.label}: "
        + ", ".join(f"{m} {figures[t.label][name][f'{m}_median_s']:.2f} s" for m in modes)
        for t in trees
    ]
    return f"{name:28s} " + " | ".join(parts)


def tiny_model_dir(directory: Path) -> Path:
    """The tiny random Llama of `tandem.testing.tiny_model` with its word-level tokenizer."""
    code = (
        "import sys\nfrom pathlib import Path\n"
        "from tandem.testing.tiny_model import save_tiny_model, save_tiny_tokenizer\n"
        "save_tiny_tokenizer(save_tiny_model('llama', Path(sys.argv[1])))"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", code, str(directory)], check=True, env=env)
    return directory


def _ratios(figures: dict, label: str, baseline: str) -> dict[str, dict[str, float]]:
    out = {}
    for name, fig in figures[label].items():
        base = figures[baseline].get(name)
        if base:
            out[name] = {
                key: round(fig[key] / base[key], 3)
                for key in fig
                if key.endswith("_median_s")
                and isinstance(fig[key], float)
                and isinstance(base.get(key), float)
                and base[key] > 0
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--label", required=True, help="name of the working tree's figures")
    parser.add_argument(
        "--baseline",
        help="LABEL=DIR: another checkout of tandem measured interleaved with the working tree",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}"
    )
    parser.add_argument("--no-cli", action="store_true", help="skip plugins list / config show")
    parser.add_argument("--no-serve", action="store_true", help="skip serve-to-healthy")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes: expected some of {', '.join(MODES)}, got {args.modes!r}")

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tandem-startup-") as scratch:
        site = Path(scratch) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        trees = [Tree(args.label, None, site)]
        if args.baseline:
            label, _, root = args.baseline.partition("=")
            trees.append(Tree(label, Path(root).resolve(), site))
        figures: dict[str, dict[str, Any]] = {t.label: {} for t in trees}
        if not args.no_cli:
            for label, found in measure_cli(trees, args.repeats, modes).items():
                figures[label].update(found)
        if not args.no_serve:
            models = {
                "scripted": "scripted",
                "tiny-llama": str(tiny_model_dir(Path(scratch) / "tiny")),
            }
            for label, found in measure_serve(trees, args.repeats, modes, models).items():
                figures[label].update(found)

    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for tree in trees:
        results[tree.label] = {
            "commands": figures[tree.label],
            "source": str(tree.source_root or ROOT),
            "repeats": args.repeats,
            "modes": modes,
            "interleaved_with": [t.label for t in trees if t is not tree],
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "cpu_count": os.cpu_count(),
            "cpu_flags": _cpu_flags(),
            "threads": "OMP_NUM_THREADS=1; serve: --worker-threads 1",
            "python": sys.version.split()[0],
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    if len(trees) == 2:
        results[f"ratio {trees[0].label}/{trees[1].label}"] = _ratios(
            figures, trees[0].label, trees[1].label
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
