"""Accuracy of each weight quantization on the embedded SmolLM2, teacher-forced.

The measurement is `tandem.accuracy` (also `tandem bench --accuracy`): the fixed text
`tests/data/accuracy_text.txt` fed in chunks as prompts, and per quantization the top-1
agreement with the float32 model (`quantization: none`) and the perplexity and its ratio.

    python benchmarks/quant_accuracy.py [--modes none,auto,int8-g32,int4-g32] [--chunk 256]

`auto` is the GGUF kept quantized (Q4_1 layers, Q8_0 embedding / LM head); `int4-gN` is
`quantization: int4` with `quantization_group_size: N`, quantized at load from the float32
weights (the GGUF's dequantized values), likewise `int8-gN` (`-g0`: one scale per output
channel). Writes `benchmarks/results/quant_accuracy.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.accuracy import ACCURACY_TEXT, measure_accuracy, summary_lines

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "quant_accuracy.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes", default="none,auto,int8-g0,int8-g32,int8-g64,int4-g32,int4-g64,int4-g128"
    )
    parser.add_argument("--chunk", type=int, default=256, help="tokens per teacher-forced prompt")
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    report = measure_accuracy(args.model, args.modes.split(","), ACCURACY_TEXT, args.chunk)
    report["benchmark"] = "quant_accuracy"
    if args.model == "default":
        report["model"] = "default (SmolLM2-135M-Instruct Q4_1 GGUF)"
    report["text"] = str(ACCURACY_TEXT.relative_to(ROOT))
    print("\n".join(summary_lines(report)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
