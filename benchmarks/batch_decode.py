"""Decode milliseconds per step against the batch size, on the embedded model (default
weights: the GGUF kept quantized), greedy, prefix caching off.

    python benchmarks/batch_decode.py [--threads 1] [--batches 1,2,4,8,16,32] [--repeats 3]

Per batch size B: B prompts of 32 random token ids run once with 1 new token and once with
33; the step time is the difference over 32, median over `--repeats`. Writes
benchmarks/results/batch_decode.json (with the CPU flags and threads). Compare two builds by
running it on each, one after the other.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from tandem import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/batch_decode.json")
    args = parser.parse_args()
    llm = LLM(
        model="default",
        worker_num_threads=args.threads,
        max_model_len=512,
        enable_prefix_caching=False,
        async_scheduling=False,
    )

    def run(batch: int, new_tokens: int, seed: int) -> float:
        rng = random.Random(seed)
        prompts = [
            {"prompt_token_ids": [rng.randint(100, 40_000) for _ in range(32)]}
            for _ in range(batch)
        ]
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    run(2, 4, 0)  # warm-up
    step_ms: dict[str, float] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        samples = []
        for r in range(args.repeats):
            first = run(batch, 1, 10 * batch + r)
            whole = run(batch, NEW_TOKENS + 1, 100 * batch + r)
            samples.append((whole - first) / NEW_TOKENS * 1000)
        step_ms[str(batch)] = round(statistics.median(samples), 2)
        print(f"batch {batch:3d}: {step_ms[str(batch)]:7.2f} ms/step", flush=True)
    from tandem.models.cpu_features import cpu_flags

    result = {
        "what": "decode ms per step (median), default weights, greedy",
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
        "threads": args.threads,
        "step_ms": step_ms,
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    llm.shutdown()


if __name__ == "__main__":
    main()
