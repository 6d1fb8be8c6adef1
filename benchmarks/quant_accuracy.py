"""Accuracy of each weight quantization on the embedded SmolLM2, teacher-forced.

The fixed text `tests/data/accuracy_text.txt` is tokenized and fed in chunks as prompts
(`prompt_logprobs=1`, one generated token). At every position after the first of a chunk
the engine reports the logprob of the true next token and its own top-1 token. Per
quantization:

- `top1_agreement`: the fraction of positions whose top-1 token equals the float32 model's
  (`quantization: none`, the baseline);
- `perplexity`: exp(-mean logprob of the true tokens), and its ratio to the baseline's.

    python benchmarks/quant_accuracy.py [--modes none,auto,int8,int4-g32] [--chunk 256]

`auto` is the GGUF kept quantized (Q4_1 layers, Q8_0 embedding / LM head); `int4-gN` is
`quantization: int4` with `quantization_group_size: N`, quantized at load from the float32
weights (the GGUF's dequantized values), likewise `int8-gN` (`-g0`: one scale per output
channel). Writes `benchmarks/results/quant_accuracy.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "accuracy_text.txt"
OUT = ROOT / "benchmarks" / "results" / "quant_accuracy.json"


def mode_settings(mode: str) -> dict[str, Any]:
    """`int8-g32` -> quantization int8 in groups of 32 (`-g0`: per output channel)."""
    if mode.startswith(("int4-g", "int8-g")):
        return {"quantization": mode[:4], "quantization_group_size": int(mode[6:])}
    return {"quantization": mode}


def teacher_forced(mode: str, chunk: int) -> tuple[list[int], list[float]]:
    """(top-1 token at every scored position, logprob of the true token there)."""
    from tandem import LLM, SamplingParams

    llm = LLM(model="default", dtype="float32", max_model_len=chunk + 8, **mode_settings(mode))
    try:
        ids = llm.get_tokenizer()(TEXT.read_text())["input_ids"]
        chunks = [ids[i : i + chunk] for i in range(0, len(ids) - 1, chunk)]
        chunks = [c for c in chunks if len(c) > 1]
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
        top1: list[int] = []
        logprobs: list[float] = []
        for tokens, out in zip(chunks, outs, strict=True):
            for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
                true = tokens[position]
                logprobs.append(entry[true].logprob)
                top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
        return top1, logprobs
    finally:
        llm.engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes", default="none,auto,int8-g0,int8-g32,int8-g64,int4-g32,int4-g64,int4-g128"
    )
    parser.add_argument("--chunk", type=int, default=256, help="tokens per teacher-forced prompt")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if modes[0] != "none":
        modes.insert(0, "none")
    runs = {mode: teacher_forced(mode, args.chunk) for mode in modes}
    base_top1, base_lp = runs["none"]
    base_ppl = math.exp(-sum(base_lp) / len(base_lp))
    results = {}
    for mode, (top1, lp) in runs.items():
        ppl = math.exp(-sum(lp) / len(lp))
        agree = sum(a == b for a, b in zip(top1, base_top1, strict=True)) / len(top1)
        results[mode] = {
            "top1_agreement": round(agree, 5),
            "perplexity": round(ppl, 4),
            "perplexity_ratio": round(ppl / base_ppl, 5),
            "positions": len(top1),
        }
        print(
            f"{mode:10s} top-1 agreement {agree:.4f}  perplexity {ppl:.3f} ({ppl / base_ppl:.4f}x)"
        )
    report = {
        "benchmark": "quant_accuracy",
        "model": "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
        "text": str(TEXT.relative_to(ROOT)),
        "chunk_tokens": args.chunk,
        "machine": platform.processor() or platform.machine(),
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
