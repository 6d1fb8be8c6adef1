"""DiffusionGemma with `model.quantization` none / int8 / int4: bytes held and denoise time.

A random DiffusionGemma of a small shape (`SMALL`: 4 layers, hidden 512, 32 experts top-4
of intermediate 256, vocabulary 8,192, canvas 32; about 4x smaller than the real model in
every dimension, with the same experts-dominate balance), saved once and loaded three
ways. For each mode:

- `text_bytes`: what the text model's weights hold (`diffusion_gemma_quant.held_bytes`;
  the unused vision tower is left out), and `expert_bytes`: the experts' part of it;
- `denoise_ms`: one `denoise` call (the decoder over R canvases of 32 tokens, each over a
  64-token cached context), median over `--rounds`, modes taking turns.

    python benchmarks/diffusion_gemma_quant.py [--threads 1] [--rows 1 4] [--rounds 9]

Writes benchmarks/results/diffusion_gemma_quant.json, with the CPU flags.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tandem.models.cpu_features import cpu_flags
from tandem.models.diffusion_gemma import DiffusionGemmaModel
from tandem.models.diffusion_gemma_quant import QuantModule, held_bytes
from tandem.models.quant_experts import QuantExperts
from tandem.models.quant_linear import LinearQuantization
from tandem.testing.tiny_diffusion_gemma import BLOCK, PagedContexts, tiny_diffusion_gemma

SMALL = {
    "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "global_head_dim": 128,
    "num_global_key_value_heads": 1, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "num_experts": 32, "top_k_experts": 4, "moe_intermediate_size": 256,
}  # fmt: skip
CANVAS = 32
CONTEXT = 64
MODES = {
    "none": LinearQuantization(),
    "int8": LinearQuantization("int8", 32),
    "int4": LinearQuantization("int4", 32),
}
OUT = Path(__file__).resolve().parent / "results" / "diffusion_gemma_quant.json"


class Contexts(PagedContexts):
    """`PagedContexts` over a model loaded with `quant`."""

    def __init__(self, path: Path, quant: LinearQuantization, num_blocks: int) -> None:
        cpu = torch.device("cpu")
        self.model = DiffusionGemmaModel(path, torch.float32, num_blocks, BLOCK, cpu, quant)
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}


def expert_bytes(model: DiffusionGemmaModel) -> int:
    """Bytes the decoder's experts hold (shared with the encoder's)."""
    total = 0
    for layer in model.decoder.layers:
        experts = layer.experts
        if isinstance(experts, QuantExperts):
            total += experts.nbytes
        else:
            total += sum(t.nbytes for t in (experts.gate_up_proj, experts.down_proj))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(tempfile.mkdtemp(prefix="dg-small-"))
    tiny_diffusion_gemma(SMALL, CANVAS).save_pretrained(path)
    reqs = [f"r{r}" for r in range(max(args.rows))]
    runs: dict[str, Contexts] = {}
    results: dict[str, dict] = {}
    for mode, quant in MODES.items():
        start = time.perf_counter()
        runs[mode] = Contexts(path, quant, num_blocks=len(reqs) * CONTEXT // BLOCK + 4)
        load_s = time.perf_counter() - start
        model = runs[mode].model
        assert isinstance(model.decoder.layers[0].self_attn.q_proj, QuantModule) == (mode != "none")
        text = [model.hf.model.encoder.language_model, model.hf.model.decoder]
        results[mode] = {
            "text_bytes": held_bytes(text),
            "expert_bytes": expert_bytes(model),
            "load_s": round(load_s, 2),
            "denoise_ms": {},
        }
        gen = torch.Generator().manual_seed(0)
        runs[mode].encode(
            [(r, torch.randint(3, 8192, (CONTEXT,), generator=gen).tolist()) for r in reqs]
        )
    gen = torch.Generator().manual_seed(1)
    for rows in args.rows:
        canvas = torch.randint(0, SMALL["vocab_size"], (rows, CANVAS), generator=gen)
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode, run in runs.items():  # modes take turns
                start = time.perf_counter()
                run.denoise(reqs[:rows], canvas, None, [False] * rows)
                times[mode].append(time.perf_counter() - start)
        for mode in MODES:
            results[mode]["denoise_ms"][rows] = round(1e3 * statistics.median(times[mode]), 2)
    report = {
        "config": {**SMALL, "canvas_length": CANVAS, "context": CONTEXT},
        "threads": args.threads,
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith("avx") or f in ("fma", "f16c")),
        "results": results,
    }
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    for mode, res in results.items():
        print(mode, res)


if __name__ == "__main__":
    main()
