"""Runs a tandem workload file through vLLM's CPU build (run with the peers venv's python).

Prints one JSON line with the same fields as tandem.bench's peers. The model is the same
converted HF directory tandem uses (from tandem's cache), so weights and token ids match.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model_dir = args.model
    if args.model == "default":
        cache = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
        model_dir = sorted(glob.glob(str(cache / "SmolLM2-135M-Instruct*")))[-1]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = json.loads(Path(args.workload).read_text())
    reqs = workload["requests"]
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enable_prefix_caching=False,
        max_model_len=2048,
        gpu_memory_utilization=0.3,
    )
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs
    ]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
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
            }
        )
    )


if __name__ == "__main__":
    main()
