"""Decode attention for 64 requests (contexts 250-380, SmolLM2's 9 query / 3 KV heads of
64): the compiled CPU kernel against the torch path (gather + grouped SDPA), the same
pools and block tables, all 30 layers cycled so the KV streams from memory. Medians,
side by side; the ratio goes to benchmarks/results/decode_attention.json.

    python benchmarks/decode_attention.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from tandem.models.cpu_kernels import paged_decode_kernel
from tandem.models.paged_attention import build_metadata, paged_attention

LAYERS, REQUESTS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 64, 9, 3, 64, 16


class _Layer:
    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/decode_attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = paged_decode_kernel()
    if kernel is None:
        raise SystemExit("the CPU decode kernel did not build (is a C++ compiler installed?)")
    rng = random.Random(0)
    seq_lens = [rng.randint(250, 380) for _ in range(REQUESTS)]
    max_blocks = -(-max(seq_lens) // BLOCK)
    num_blocks = REQUESTS * max_blocks + 1
    block_tables = torch.randperm(num_blocks)[: REQUESTS * max_blocks].view(REQUESTS, -1)
    slots = torch.tensor(
        [
            int(block_tables[r, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
            for r, n in enumerate(seq_lens)
        ]
    )
    qsl = list(range(REQUESTS + 1))
    starts = [n - 1 for n in seq_lens]
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    values = [torch.randn(shape) for _ in range(LAYERS)]
    keys = [torch.randn(shape) for _ in range(LAYERS)]
    keys_t = [k.permute(0, 2, 3, 1).contiguous() for k in keys]
    plans = {
        "torch": build_metadata(
            list(zip(keys, values, strict=True)), slots, qsl, starts, seq_lens, block_tables, BLOCK
        ),
        "kernel": build_metadata(
            list(zip(keys_t, values, strict=True)),
            slots,
            qsl,
            starts,
            seq_lens,
            block_tables,
            BLOCK,
            kernel,
        ),
    }
    q = torch.randn(1, Q_HEADS, REQUESTS, HEAD_DIM)
    k_new = torch.randn(1, KV_HEADS, REQUESTS, HEAD_DIM)
    v_new = torch.randn(1, KV_HEADS, REQUESTS, HEAD_DIM)

    def step(name: str) -> torch.Tensor:
        for layer in range(LAYERS):
            out, _ = paged_attention(_Layer(layer), q, k_new, v_new, None, paged=plans[name])
        return out

    torch.testing.assert_close(step("kernel"), step("torch"), atol=2e-5, rtol=1e-4)
    times: dict[str, list[float]] = {"torch": [], "kernel": []}
    for _ in range(7):
        for name in times:
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    speedup = medians["torch"] / medians["kernel"]
    print(f"decode attention, {REQUESTS} requests x {LAYERS} layers: kernel {speedup:.2f}x torch")
    Path(args.out).write_text(
        json.dumps({"threads": args.threads, "kernel_speedup_over_torch": speedup}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
