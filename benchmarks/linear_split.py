"""`split_linear` against `F.linear` on the embedded model's projection shapes.

All 30 layers' weights (fp32, 270 MB for the four projections) are cycled so they stream
from memory as in a real step; the LM head is timed alone. Medians over repeats, measured
side by side in one process; ratios go to benchmarks/results/linear_split.json.

    python benchmarks/linear_split.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.core.worker.split_linear import split_linear

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
LM_HEAD = (49152, 576)


def median_ms(fn: Callable[[], object], repeats: int = 9) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/linear_split.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = [[torch.randn(o, i) for o, i in LAYER_SHAPES] for _ in range(30)]
    head = torch.randn(*LM_HEAD)
    rows_out = []
    for rows in (1, 2, 8, 64, 512, 2048):
        xs = [torch.randn(rows, i) for _, i in LAYER_SHAPES]
        x = torch.randn(rows, LM_HEAD[1])

        def layers_with(op: Callable[..., torch.Tensor], xs: list[torch.Tensor] = xs) -> None:
            for weights in layers:
                for w, inp in zip(weights, xs, strict=True):
                    op(inp, w)

        base_layers = median_ms(lambda: layers_with(F.linear))
        split_layers = median_ms(lambda: layers_with(split_linear))
        base_head = median_ms(lambda x=x: F.linear(x, head))
        split_head = median_ms(lambda x=x: split_linear(x, head))
        rows_out.append(
            {
                "rows": rows,
                "layers_speedup": base_layers / split_layers,
                "lm_head_speedup": base_head / split_head,
            }
        )
        print(
            f"rows {rows:5d}: 30 layers {base_layers / split_layers:.2f}x, "
            f"LM head {base_head / split_head:.2f}x"
        )
    result = {"threads": args.threads, "results": rows_out}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
