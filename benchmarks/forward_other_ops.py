"""What the fused decoder's non-linear ops (norms, RoPE, SwiGLU, residuals) cost per step.

Explains step_costs.py's `forward_other` phase: the same op sequence as
`fused_decoder.FusedDecoder.forward` minus the linears and attention, on random tensors of
SmolLM2-135M's shapes (30 layers, hidden 576, 9/3 heads of 64, intermediate 1536), for a
decode step of 64 rows and a prefill chunk of 2048, one torch thread by default. Beside
it, variants a change to fused_decoder.py could take: `F.rms_norm` (one op for six) and
in-place residual adds and SwiGLU; their largest difference from the current ops is
printed (float32, so exactness is not expected of `F.rms_norm`).

    python benchmarks/forward_other_ops.py [--threads 1] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.core.worker.fused_decoder import _rms_norm, _rotate_half

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
        "down": r(rows, HIDDEN),
    }


def current(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """One layer's non-linear ops as fused_decoder runs them (linear outputs given)."""
    h, w, qkv, cos, sin = t["h"], t["w"], t["qkv"], t["cos"], t["sin"]
    rows, q_size, kv_size = h.shape[0], HEADS * DIM, KV_HEADS * DIM
    _rms_norm(h, w, EPS)
    q = qkv[:, :q_size].view(rows, HEADS, DIM)
    k = qkv[:, q_size : q_size + kv_size].view(rows, KV_HEADS, DIM)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    h = h + t["down"]
    _rms_norm(h, w, EPS)
    act = F.silu(t["gate_up"][:, :INTER]) * t["gate_up"][:, INTER:]
    return h + act[:, :HIDDEN]


def fused_variant(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The same with `F.rms_norm`, in-place residual adds and an in-place SwiGLU product."""
    h, w, qkv, cos, sin = t["h"], t["w"], t["qkv"], t["cos"], t["sin"]
    rows, q_size, kv_size = h.shape[0], HEADS * DIM, KV_HEADS * DIM
    F.rms_norm(h, (HIDDEN,), w, EPS)
    q = qkv[:, :q_size].view(rows, HEADS, DIM)
    k = qkv[:, q_size : q_size + kv_size].view(rows, KV_HEADS, DIM)
    q = torch.addcmul(q * cos, _rotate_half(q), sin)
    k = torch.addcmul(k * cos, _rotate_half(k), sin)
    h.add_(t["down"])
    F.rms_norm(h, (HIDDEN,), w, EPS)
    act = F.silu(t["gate_up"][:, :INTER]).mul_(t["gate_up"][:, INTER:])
    return h.add_(act[:, :HIDDEN])


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
    x = torch.randn(64, HIDDEN)
    w = torch.randn(HIDDEN)
    diff = (_rms_norm(x, w, EPS) - F.rms_norm(x, (HIDDEN,), w, EPS)).abs().max().item()
    result: dict[str, object] = {"threads": args.threads, "rms_norm_max_abs_diff": diff}
    with torch.inference_mode():
        for rows in (64, 2048):
            result[f"rows{rows}_current_ms_per_step"] = _ms_per_step(current, rows, args.repeats)
            result[f"rows{rows}_variant_ms_per_step"] = _ms_per_step(
                fused_variant, rows, args.repeats
            )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
