"""`split_linear` and oneDNN-packed `PackedLinear` against `F.linear` on the embedded
model's projection shapes.

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

from tandem.models.packed_linear import PackedLinear
from tandem.models.split_linear import split_linear

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
    packed = [[PackedLinear(w) for w in weights] for weights in layers]
    packed_head = PackedLinear(head)
    rows_out = []
    for rows in (1, 2, 8, 64, 512, 2048):
        xs = [torch.randn(rows, i) for _, i in LAYER_SHAPES]
        x = torch.randn(rows, LM_HEAD[1])

        def layers_with(op: Callable[..., torch.Tensor], xs: list[torch.Tensor] = xs) -> None:
            for weights in layers:
                for w, inp in zip(weights, xs, strict=True):
                    op(inp, w)

        def packed_layers(xs: list[torch.Tensor] = xs) -> None:
            for weights in packed:
                for layer, inp in zip(weights, xs, strict=True):
                    layer(inp)

        base_layers = median_ms(lambda: layers_with(F.linear))
        split_layers = median_ms(lambda: layers_with(split_linear))
        packed_ms = median_ms(packed_layers)
        base_head = median_ms(lambda x=x: F.linear(x, head))
        split_head = median_ms(lambda x=x: split_linear(x, head))
        packed_head_ms = median_ms(lambda x=x: packed_head(x))
        rows_out.append(
            {
                "rows": rows,
                "layers_split_speedup": base_layers / split_layers,  # 1.0 over 256 rows
                "lm_head_split_speedup": base_head / split_head,
                "layers_packed_speedup": base_layers / packed_ms,
                "lm_head_packed_speedup": base_head / packed_head_ms,
            }
        )
        print(
            f"rows {rows:5d}: over F.linear, split 30 layers {base_layers / split_layers:.2f}x "
            f"LM head {base_head / split_head:.2f}x; packed 30 layers "
            f"{base_layers / packed_ms:.2f}x LM head {base_head / packed_head_ms:.2f}x"
        )
    result = {"threads": args.threads, "results": rows_out}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
