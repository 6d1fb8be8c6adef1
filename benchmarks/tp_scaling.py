"""Ranks on this host: TP=N x 1 thread and PP=N x 1 thread against TP=1 x N threads, side by
side (async scheduling, the default, for all three).

    python benchmarks/tp_scaling.py [--repeats 3] [--model tiny-1024|default] [--tp 2]

Each configuration runs in a fresh process, interleaved over `--repeats` rounds (medians).
Two workloads per run: one stream (batch 1, 64-token prompt, `--decode-tokens` greedy
tokens: ms per output token) and a batch (`--batch` prompts of 64-256 tokens, 64 greedy
tokens each: output tokens/s). For TP runs the ranks report the time, calls and bytes of
their collectives (`collective_rpc("describe")`), so the JSON holds the collective share of
the wall time and the bytes per decoded token.

Models: `tiny-1024` is a random-initialised Llama (hidden 1024, 16 heads, 8 KV heads,
intermediate 2816, 8 layers, vocab 32000), written once to a temporary directory: its heads
divide by 2 and 4. `default` (SmolLM2-135M: 9 heads, 3 KV heads) divides by 3 only.
Writes benchmarks/results/tp_scaling.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tiny_1024(directory: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=1024,
    )
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory


def _prompts(n: int, seed: int, low: int, high: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, vocab - 1) for _ in range(rng.randint(low, high))] for _ in range(n)]


def child(
    model: str,
    tp: int,
    pp: int,
    threads: int,
    batch: int,
    decode_tokens: int,
    partition: list[int] | None = None,
) -> dict:
    from tandem import LLM, SamplingParams

    kw: dict = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp} if tp * pp > 1 else {}
    if partition:
        kw["pp_layer_partition"] = partition
    llm = LLM(model=model, worker_num_threads=threads, max_model_len=1024, **kw)
    vocab = llm.config.model.vocab_size
    one = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(_prompts(2, 99, 16, 32, vocab), many, use_tqdm=False)  # warm up

    def collectives() -> tuple[float, int, int]:
        if tp == 1:  # pipeline transfers are not collectives: see the step spans
            return 0.0, 0, 0
        ranks = llm.engine.executor.collective_rpc("describe")
        r0 = ranks[0]
        return r0["collective_s"], r0["collective_calls"], r0["collective_bytes"]

    result = {}
    for name, prompts, params in (
        ("stream", _prompts(1, 1, 64, 64, vocab), one),
        ("batch", _prompts(batch, 2, 64, 256, vocab), many),
    ):
        before = collectives()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = collectives()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result[name] = {
            "wall_s": wall,
            "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall,
            "ms_per_output_token": 1000 * wall / tokens,
            "collective_s_rank0": after[0] - before[0],
            "collective_calls_rank0": after[1] - before[1],
            "collective_bytes_rank0": after[2] - before[2],
            "collective_share": (after[0] - before[0]) / wall,
        }
    if pp > 1:  # the batch's execute spans per rank: the trace lanes
        result["spans"] = llm.engine.executor.collective_rpc("step_spans")
    llm.engine.shutdown()
    return result


def _run_child(
    model: str,
    tp: int,
    pp: int,
    threads: int,
    args: argparse.Namespace,
    partition: list[int] | None = None,
) -> dict:
    cmd = [sys.executable, __file__, "--child", model, "--tp", str(tp), "--pp", str(pp)]
    cmd += ["--threads", str(threads)]
    if partition:
        cmd += ["--partition", ",".join(map(str, partition))]
    cmd += ["--batch", str(args.batch), "--decode-tokens", str(args.decode_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return sorted({f for f in flags.split() if f.startswith(("avx512", "amx", "avx2"))})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--model", default="tiny-1024")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--partition",
        default="",
        help="also run pp=N x 1 thread with this pp_layer_partition (e.g. 5,3)",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tp_scaling"))
    args = parser.parse_args()
    partition = [int(x) for x in args.partition.split(",")] if args.partition else None
    if args.child:
        r = child(
            args.child, args.tp, args.pp, args.threads, args.batch, args.decode_tokens, partition
        )
        print(json.dumps(r))
        return
    model = args.model
    if model == "tiny-1024":
        model = str(_tiny_1024(Path(tempfile.gettempdir()) / "tandem-tp-tiny-1024"))
    n = args.tp
    configs: dict[str, tuple[int, int, int, list[int] | None]] = {
        f"tp=1 x {n} threads": (1, 1, n, None),
        f"tp={n} x 1 thread": (n, 1, 1, None),
        f"pp={n} x 1 thread": (1, n, 1, None),
    }
    if partition:
        configs[f"pp={n} {partition} x 1 thread"] = (1, n, 1, partition)
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, (tp, pp, threads, part) in configs.items():
            runs[name].append(_run_child(model, tp, pp, threads, args, part))
            r = runs[name][-1]
            print(
                f"{name}: stream {r['stream']['ms_per_output_token']:.1f} ms/token, "
                f"batch {r['batch']['output_tokens_per_s']:.1f} tok/s, collectives "
                f"{100 * r['batch']['collective_share']:.0f}% of the batch",
                flush=True,
            )

    def med(name: str, kind: str, key: str) -> float:
        return statistics.median(r[kind][key] for r in runs[name])

    one, many, staged, *balanced = configs
    summary = {
        name: {
            "stream_ms_per_token": med(name, "stream", "ms_per_output_token"),
            "batch_tokens_per_s": med(name, "batch", "output_tokens_per_s"),
            "stream_collective_share": med(name, "stream", "collective_share"),
            "batch_collective_share": med(name, "batch", "collective_share"),
            "stream_collective_bytes_per_token": med(name, "stream", "collective_bytes_rank0")
            / max(1, runs[name][0]["stream"]["output_tokens"]),
        }
        for name in configs
    }
    result = {
        "model": args.model,
        "tp": n,
        "repeats": args.repeats,
        "batch": args.batch,
        "decode_tokens": args.decode_tokens,
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": _cpu_flags(),
        "cores": len(os.sched_getaffinity(0)),
        "runs": runs,
        "median": summary,
        "ratios_over_threads": {
            name: {
                "stream_ms_per_token": summary[name]["stream_ms_per_token"]
                / summary[one]["stream_ms_per_token"],
                "batch_tokens_per_s": summary[name]["batch_tokens_per_s"]
                / summary[one]["batch_tokens_per_s"],
            }
            for name in (many, staged, *balanced)
        },
    }
    spans = runs[staged][-1].get("spans")
    if spans:
        _chrome_trace(spans, out_trace := Path(args.out + "_pp_trace.json"))
        result["pp_trace"] = (
            str(out_trace.relative_to(ROOT)) if out_trace.is_relative_to(ROOT) else str(out_trace)
        )
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(summary, out.with_suffix(".png"))
    print(json.dumps(result["median"], indent=2))
    print(json.dumps(result["ratios_over_threads"], indent=2))


def _chrome_trace(spans: list[list[list[float]]], path: Path) -> None:
    """The last repeat's pipeline run as a Chrome trace: one lane per rank, one box per
    `execute_model` (the last 40 steps)."""
    t0 = min(s[1] for lane in spans for s in lane)
    events = []
    for rank, lane in enumerate(spans):
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": rank,
                "args": {"name": f"rank {rank} (stage {rank})"},
            }
        )
        for step, start, end in lane[-40:]:
            events.append(
                {
                    "name": f"step {int(step)}",
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": (start - t0) * 1e6,
                    "dur": (end - start) * 1e6,
                }
            )
    path.write_text(json.dumps({"traceEvents": events}) + "\n")


def _plot(summary: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(names, [summary[n]["stream_ms_per_token"] for n in names])
    axes[0].set_title("one stream: ms per output token (lower is better)")
    axes[1].bar(names, [summary[n]["batch_tokens_per_s"] for n in names])
    axes[1].set_title("batch: output tokens/s (higher is better)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
