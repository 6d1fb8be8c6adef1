"""Runs a tandem workload file through vLLM's CPU build (run with the peers venv's python).

Prints one JSON line with the same fields as tandem.bench's peers. The model is the same
converted HF directory tandem uses (from tandem's cache), so weights and token ids match.
The workload's "engine" section configures vLLM as its users would (`max_num_seqs`,
`max_model_len`, `enable_prefix_caching`, `max_num_batched_tokens`; `kv_cache_memory_gib`
becomes VLLM_CPU_KVCACHE_SPACE). The warm-up request is tandem.bench's WARMUP_PROMPT.
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

#: Defaults for a workload without an "engine" section (this runner's settings before
#: workload files carried one).
DEFAULT_ENGINE: dict[str, Any] = {"max_model_len": 2048, "enable_prefix_caching": False}
LLM_KEYS = ("max_num_seqs", "max_model_len", "enable_prefix_caching", "max_num_batched_tokens")
WARMUP_PROMPT = list(range(100, 116))  # the same as tandem.bench.WARMUP_PROMPT


def llm_kwargs(engine: dict[str, Any]) -> dict[str, Any]:
    """vLLM `LLM(...)` keywords of a workload's engine section; sets VLLM_CPU_KVCACHE_SPACE
    from `kv_cache_memory_gib` (before the engine starts, so its processes inherit it)."""
    if "kv_cache_memory_gib" in engine:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(engine["kv_cache_memory_gib"]))
    merged = DEFAULT_ENGINE | engine
    return {k: merged[k] for k in LLM_KEYS if k in merged}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="weights and KV cache (auto KV dtype)")
    args = parser.parse_args()
    model_dir = args.model
    if args.model == "default":
        cache = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
        model_dir = sorted(glob.glob(str(cache / "SmolLM2-135M-Instruct*")))[-1]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = json.loads(Path(args.workload).read_text())
    reqs = workload["requests"]
    engine_kwargs = llm_kwargs(workload.get("engine", {}))
    llm = LLM(model=model_dir, dtype=args.dtype, gpu_memory_utilization=0.3, **engine_kwargs)
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs
    ]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
    llm.generate(
        [TokensPrompt(prompt_token_ids=WARMUP_PROMPT)],
        SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False,
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    cache = llm.llm_engine.vllm_config.cache_config
    kv_pool = {
        "kv_pool_tokens": (cache.num_gpu_blocks or 0) * cache.block_size,
        "block_size": cache.block_size,
        "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
    }
    print(
        json.dumps(
            {
                "output_tokens": tokens,
                "elapsed_s": elapsed,
                "output_tokens_per_s": tokens / elapsed,
                "ttft_median_s": None,
                "tpot_median_s": elapsed / max(r["max_tokens"] for r in reqs)
                if len(reqs) == 1
                else None,
                "threads": args.threads,
                "config": engine_kwargs,
                **kv_pool,
                "max_rss_self_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "max_rss_children_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
                / 1024,
            }
        )
    )


if __name__ == "__main__":
    main()
