"""Quantized linears (`models/quant_linear.py`) against the float32 panel GEMM and torch's
own weight-only CPU kernels, on SmolLM2-135M's projection shapes.

Candidates per (shape, rows), taking turns (interleaved), median time of each:

- `f32_panel`: `F32PanelLinear` (today's float32 path, the baseline);
- `q8` / `q4_g32`: `QuantLinear` over int8 per-channel / int4 group-32 weights (the GGUF
  Q8_0 and Q4_1 layers run the same code with group-32 scales);
- `torch_int8pack`: `torch.ops.aten._weight_int8pack_mm` (int8 per channel);
- `torch_int4pack`: `torch.ops.aten._weight_int4pack_mm_for_cpu` (int4 group 32).

Products of at most 16 rows cycle through enough copies of each layer (>= 32 MB of float32
weights) that they stream their weights from memory, as in a decode step.

    python benchmarks/quant_linear.py [--threads 2] [--rows 1 4 16 64]

Writes benchmarks/results/quant_linear.json: times relative to `f32_panel` (below 1 is
faster), with the CPU flags.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.models.cpu_features import cpu_flags
from tandem.models.panel_linear import F32PanelLinear
from tandem.models.quant_linear import QuantLinear
from tandem.models.quantized_weight import quantize_int4, quantize_int8

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SHAPES_HEAD = {"lm_head": (49152, 576)}
STREAM_BYTES = 32 << 20
ROUNDS = 7
OUT = Path(__file__).resolve().parent / "results" / "quant_linear.json"
Layer = Callable[[torch.Tensor], torch.Tensor]


def torch_int8(weight: torch.Tensor) -> Layer:
    scales = weight.abs().amax(dim=1) / 127
    codes = torch.round(weight / scales[:, None]).to(torch.int8)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, scales)


def torch_int4(weight: torch.Tensor, group: int = 32) -> Layer:
    out, inn = weight.shape
    grouped = weight.view(out, inn // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = (high - low) / 15
    codes = torch.round((grouped - low[..., None]) / scales[..., None]).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.view(out, inn).to(torch.int32), 1
    )
    scales_zeros = torch.stack([scales.t(), (low + 8 * scales).t()], dim=-1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


def candidates(weight: torch.Tensor, with_torch: bool) -> dict[str, Layer]:
    made: dict[str, Layer] = {
        "f32_panel": F32PanelLinear(weight),
        "q8": QuantLinear(quantize_int8(weight)),
        "q4_g32": QuantLinear(quantize_int4(weight, 32)),
    }
    if with_torch:
        made["torch_int8pack"] = torch_int8(weight)
        made["torch_int4pack"] = torch_int4(weight)
    return made


def measure(shape: tuple[int, int], rows: int, with_torch: bool) -> dict[str, float]:
    out, inn = shape
    copies = max(1, STREAM_BYTES // (out * inn * 4)) if rows <= 16 else 1
    layers = [candidates(torch.randn(out, inn) * 0.05, with_torch) for _ in range(copies)]
    x = torch.randn(rows, inn)
    times: dict[str, list[float]] = {name: [] for name in layers[0]}
    for _ in range(ROUNDS):
        for name in times:
            for copy in layers:  # warm: the first round is dropped below
                copy[name](x)
            start = time.perf_counter()
            for copy in layers:
                copy[name](x)
            times[name].append((time.perf_counter() - start) / len(layers))
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--no-torch", action="store_true", help="skip torch's int kernels")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for name, shape in {**SHAPES, **SHAPES_HEAD}.items():
        for rows in args.rows:
            with_torch = not args.no_torch and name != "lm_head"
            medians = measure(shape, rows, with_torch)
            base = medians["f32_panel"]
            ratios = {k: round(v / base, 3) for k, v in medians.items()}
            results.append({"layer": name, "shape": shape, "rows": rows, "time_vs_f32": ratios})
            print(name, rows, ratios, flush=True)
    flags = cpu_flags()
    report = {
        "benchmark": "quant_linear",
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))),
        "load_average": os.getloadavg(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
