"""Time to first token with prefill chunks attended as decodes (the compiled CPU decode
kernel) against the flash prefill path, on the embedded model.

    python benchmarks/prefill_as_decodes.py [--threads 2] [--lengths 64,128,250,400,700,1024]
        [--repeats 7] [--settings auto,bf16] [--prefix 0]

One engine per setting (`auto`: the GGUF kept quantized, float32 activations; `bf16`:
`quantization=none, dtype=bfloat16`), prefix caching off. Per prompt length, each repeat
runs one fresh prompt (random ids, 1 new token) with `MAX_CONTEXT_AS_KERNEL_DECODES` set to
0 (every prefill chunk on the flash path) and one with it at the length (attended as
decodes), taking turns; the first repeat is dropped, the median of the rest kept. With
`--prefix P` each prompt is P cached tokens (the same P-token head, run once first with
prefix caching on) plus the length in new tokens, so the chunk attends a cached prefix.

Writes benchmarks/results/prefill_as_decodes.json (medians, decodes / flash ratios, CPU
flags, threads).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import tandem.models.paged_attention as paged_attention
from tandem import LLM, SamplingParams
from tandem.models.cpu_features import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
SETTINGS: dict[str, dict[str, Any]] = {
    "auto": {},
    "bf16": {"quantization": "none", "dtype": "bfloat16"},
}


def time_prompt(llm: LLM, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", default="64,128,250,400,700,1024")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--settings", default="auto,bf16")
    parser.add_argument("--prefix", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/prefill_as_decodes.json"
    )
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    rng = random.Random(0)
    results: dict[str, Any] = {}
    default_limit = paged_attention.MAX_CONTEXT_AS_KERNEL_DECODES
    for setting in args.settings.split(","):
        llm = LLM(
            model="default",
            worker_num_threads=args.threads,
            enable_prefix_caching=args.prefix > 0,
            max_model_len=args.prefix + max(lengths) + 16,
            **SETTINGS[setting],
        )
        vocab = llm.config.model.vocab_size or 32000
        head = [rng.randrange(10, vocab) for _ in range(args.prefix)]
        if head:
            time_prompt(llm, head)  # cache the prefix
        try:
            for n in lengths:
                times: dict[str, list[float]] = {"flash": [], "decodes": []}
                for _ in range(args.repeats):
                    for path, limit in (("flash", 0), ("decodes", args.prefix + n)):
                        paged_attention.MAX_CONTEXT_AS_KERNEL_DECODES = limit
                        prompt = head + [rng.randrange(10, vocab) for _ in range(n)]
                        times[path].append(time_prompt(llm, prompt))
                medians = {k: statistics.median(v[1:]) * 1000 for k, v in times.items()}
                row = {f"{k}_ms": round(v, 2) for k, v in medians.items()}
                row["decodes_vs_flash"] = round(medians["decodes"] / medians["flash"], 3)
                results[f"{setting}/{n}"] = row
                print(setting, n, row, flush=True)
        finally:
            paged_attention.MAX_CONTEXT_AS_KERNEL_DECODES = default_limit
            llm.engine.shutdown()
    report = {
        "benchmark": "prefill_as_decodes",
        "what": "time to first token (ms, median), prefill attended as decodes vs flash",
        "threads": args.threads,
        "prefix_tokens": args.prefix,
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
        "load_average": os.getloadavg(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
