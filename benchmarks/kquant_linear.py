"""Kept GGUF K-quant layers (Q4_K, Q6_K) against Q4_1 / Q8_0 and the float32 panel GEMM.

Shapes of a ~1B Llama (inputs multiples of 256, whole K-quant super-blocks; SmolLM2's 576
inputs are not). `Q4_K->8bit_g16` is a Q4_K weight as a Q4_K_M file's fused Q/K/V holds it
next to a Q6_K V (`QuantizedWeight.cat`). Candidates take turns; median of the rounds after
the first. Products of at most 16 rows cycle through >= 32 MB of float32 copies (weights
stream from memory, as in decode).

    python benchmarks/kquant_linear.py [--threads 1] [--rows 1 4 16 64]

Prints each layer's time relative to `f32_panel` (below 1 is faster) and the bytes a
weight each format holds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from tandem.models.panel_linear import F32PanelLinear
from tandem.models.quant_linear import QuantLinear
from tandem.models.quantized_weight import from_gguf_blocks
from tandem.testing.tiny_gguf import gguf_blocks

SHAPES = {"qkv": (1536, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)}
STREAM_BYTES = 32 << 20
ROUNDS = 11
Layer = Callable[[torch.Tensor], torch.Tensor]


def candidates(weight: torch.Tensor) -> dict[str, Layer]:
    data = weight.numpy()
    made: dict[str, Layer] = {"f32_panel": F32PanelLinear(weight)}
    for kind in ("Q4_1", "Q4_K", "Q8_0", "Q6_K"):
        made[kind] = QuantLinear(from_gguf_blocks(kind, gguf_blocks(kind, data), weight.shape))
    q4k = from_gguf_blocks("Q4_K", gguf_blocks("Q4_K", data), weight.shape)
    made["Q4_K->8bit_g16"] = QuantLinear(q4k.regroup(8, 16))
    return made


def measure(shape: tuple[int, int], rows: int) -> tuple[dict[str, float], dict[str, Layer]]:
    out, inn = shape
    copies = max(1, STREAM_BYTES // (out * inn * 4)) if rows <= 16 else 1
    layers = [candidates(torch.randn(out, inn) * 0.05) for _ in range(copies)]
    x = torch.randn(rows, inn)
    times: dict[str, list[float]] = {name: [] for name in layers[0]}
    for _ in range(ROUNDS):
        for name in times:
            for copy in layers:
                copy[name](x)
            start = time.perf_counter()
            for copy in layers:
                copy[name](x)
            times[name].append((time.perf_counter() - start) / len(layers))
    return {name: statistics.median(t[1:]) for name, t in times.items()}, layers[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("load average", os.getloadavg())
    for name, shape in SHAPES.items():
        for rows in args.rows:
            medians, layers = measure(shape, rows)
            base = medians.pop("f32_panel")
            ratios = {k: round(v / base, 3) for k, v in medians.items()}
            print(name, shape, rows, f"f32_panel {base * 1e3:.3f} ms", ratios, flush=True)
        weights = shape[0] * shape[1]
        held = {k: round(v.nbytes / weights, 4) for k, v in layers.items() if k != "f32_panel"}
        print("  bytes a weight", held)
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
