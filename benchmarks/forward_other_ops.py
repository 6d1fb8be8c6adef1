"""What the fused decoder's element-wise ops (norms, RoPE, SwiGLU, residuals) cost per step.

Explains step_costs.py's `forward_other` phase: one layer's element-wise steps, as
`fused_decoder.FusedDecoder.forward` runs them between the linears and attention, 30 times,
on random tensors of SmolLM2-135M's shapes (30 layers, hidden 576, 9/3 heads of 64,
intermediate 1536), for a decode step of 64 rows and a prefill chunk of 2048, one torch
thread by default. Three implementations: `before` (the torch op chain the decoder ran
before the compiled kernels, kept here as the baseline), `torch` (`TorchElementwise`, the
fallback) and `kernels` (`FusedElementwise`, the compiled CPU kernels, the default on a
float32 CPU). Best of `--repeats`; writes `benchmarks/results/forward_other_ops.json`.

    python benchmarks/forward_other_ops.py [--threads 1] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.models.decoder_elementwise import (
    Elementwise,
    FusedElementwise,
    TorchElementwise,
)
from tandem.models.fused_ops import fused_ops

LAYERS, HIDDEN, HEADS, KV_HEADS, DIM, INTER, EPS = 30, 576, 9, 3, 64, 1536, 1e-5


def _tensors(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "h": r(rows, HIDDEN),
        "w": r(HIDDEN),
        "qkv": r(rows, (HEADS + 2 * KV_HEADS) * DIM),
        "cos": r(rows, 1, DIM),
        "sin": r(rows, 1, DIM),
        "gate_up": r(rows, 2 * INTER),
        "cos_table": r(4096, DIM),
        "sin_table": r(4096, DIM),
        "positions": torch.randint(0, 4096, (rows,), generator=g),
        "down": r(rows, HIDDEN),
    }


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., DIM // 2 :], x[..., : DIM // 2]), dim=-1)


def before(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """One layer's element-wise ops as the decoder ran them before the compiled kernels."""
    h, w, qkv, cos, sin = t["h"], t["w"], t["qkv"], t["cos"], t["sin"]
    rows, q_size, kv_size = h.shape[0], HEADS * DIM, KV_HEADS * DIM
    q = qkv[:, :q_size].view(rows, HEADS, DIM)
    k = qkv[:, q_size : q_size + kv_size].view(rows, KV_HEADS, DIM)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    h = h + t["down"]
    _rms_norm(h, w)
    act = F.silu(t["gate_up"][:, :INTER]) * t["gate_up"][:, INTER:]
    h = h + act[:, :HIDDEN]
    return _rms_norm(h, w)


def with_elementwise(ew: Elementwise) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """One layer's element-wise steps through `ew`, as `FusedDecoder.forward` calls them."""

    def layer(t: dict[str, torch.Tensor]) -> torch.Tensor:
        table = (t["cos_table"], t["sin_table"], t["positions"])
        ew.rope_(t["qkv"], table, HEADS, KV_HEADS)
        ew.add_rms_norm_(t["h"], t["down"], t["w"], EPS)
        act = ew.silu_mul(t["gate_up"])
        return ew.add_rms_norm_(t["h"], act[:, :HIDDEN].contiguous(), t["w"], EPS)

    return layer


def _ms_per_step(fn: Callable[[dict[str, torch.Tensor]], torch.Tensor], rows: int, n: int) -> float:
    t = _tensors(rows)
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        for _ in range(LAYERS):
            fn(t)
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = {"before": before, "torch": with_elementwise(TorchElementwise())}
    ops = fused_ops()
    if ops is not None:
        variants["kernels"] = with_elementwise(FusedElementwise(ops))
    result: dict[str, object] = {
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "ms_per_step": {},
    }
    with torch.inference_mode():
        for rows in (1, 64, 2048):
            result["ms_per_step"][f"rows{rows}"] = {  # type: ignore[index]
                name: _ms_per_step(fn, rows, args.repeats) for name, fn in variants.items()
            }
    print(json.dumps(result, indent=2))
    out = Path(__file__).parent / "results" / "forward_other_ops.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
