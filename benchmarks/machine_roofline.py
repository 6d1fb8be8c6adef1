"""The machine's limits for a workload: fp32 matmul roofline, memory bandwidth, CPU flags.

`measure(threads)` times fp32 `torch.mm` on the model's shapes (the best per-shape median
is the roofline, GFLOP/s) and the bandwidth of reading (`sum`) and copying a 512 MiB
tensor. `model_params(model_dir)` counts SmolLM2's weights from its safetensors headers.
From those:
- `throughput_ceiling(workload, params, gflops)`: output tokens/s if every matmul ran at
  the roofline: 2 x body params per computed token (prompt tokens, minus those a perfect
  prefix cache skips when the workload enables it, plus every output token but the last
  of each request) and 2 x lm_head params per output token (logits only where sampling);
  attention FLOPs are left out, so it is an upper bound.
- `bandwidth_floor_ms(params, read_gbps)`: batch 1 reads every weight once per token
  (body + lm_head, fp32: about 0.54 GB for SmolLM2-135M).
"""

from __future__ import annotations

import json
import os
import statistics
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

MATMUL_SHAPES = ((64, 576, 1536), (256, 576, 49152), (2048, 576, 1536), (64, 1536, 576))
FLAG_PREFIXES = ("avx2", "avx512", "amx", "fma", "f16c")


def cpu_flags() -> dict[str, Any]:
    """Model name and the vector flags lscpu reports (avx2, avx512*, amx*)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {"model_name": None, "flags": []}
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    return {
        "model_name": info.get("Model name", "").strip() or None,
        "cpus": (info.get("CPU(s)") or "").strip() or None,
        "flags": sorted(f for f in flags if f.startswith(FLAG_PREFIXES)),
    }


def _median_seconds(fn: Any, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(threads: int, repeats: int = 5) -> dict[str, Any]:
    """fp32 matmul GFLOP/s per shape ([m, k] x [k, n]), the roofline and GB/s."""
    import torch

    torch.set_num_threads(threads)
    gflops: dict[str, float] = {}
    with torch.inference_mode():
        for m, k, n in MATMUL_SHAPES:
            a, b = torch.randn(m, k), torch.randn(k, n)
            secs = _median_seconds(lambda a=a, b=b: torch.mm(a, b), repeats)
            gflops[f"[{m},{k}]x[{k},{n}]"] = 2 * m * k * n / secs / 1e9
        big = torch.ones(128 << 20)  # 512 MiB of fp32
        dst = torch.empty_like(big)
        read_s = _median_seconds(big.sum, repeats)
        copy_s = _median_seconds(lambda: dst.copy_(big), repeats)
    nbytes = big.numel() * 4
    return {
        "threads": threads,
        "matmul_gflops": gflops,
        "roofline_gflops": max(gflops.values()),
        "read_gbps": nbytes / read_s / 1e9,
        "copy_gbps": 2 * nbytes / copy_s / 1e9,  # bytes read + written
    }


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def model_params(model_dir: str | Path) -> dict[str, int]:
    """Parameter counts: `embedding`, `body` (everything else but lm_head), `lm_head`
    (the embedding matrix when tied)."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        shapes |= _safetensors_shapes(file)

    def numel(shape: list[int]) -> int:
        n = 1
        for d in shape:
            n *= d
        return n

    embedding = sum(numel(s) for k, s in shapes.items() if "embed_tokens" in k)
    head = sum(numel(s) for k, s in shapes.items() if "lm_head" in k) or embedding
    body = sum(
        numel(s) for k, s in shapes.items() if "embed_tokens" not in k and "lm_head" not in k
    )
    return {"embedding": embedding, "body": body, "lm_head": head}


def computed_prompt_tokens(workload: dict[str, Any]) -> int:
    """Prompt tokens an engine must compute: all of them, or with prefix caching on only
    the distinct prefixes (a trie over the prompts: what a perfect prefix cache leaves)."""
    prompts = [r["prompt_token_ids"] for r in workload["requests"]]
    if not workload.get("engine", {}).get("enable_prefix_caching"):
        return sum(len(p) for p in prompts)
    root: dict[int, Any] = {}
    nodes = 0
    for prompt in prompts:
        node = root
        for tok in prompt:
            if tok not in node:
                node[tok] = {}
                nodes += 1
            node = node[tok]
    return nodes


def throughput_ceiling(workload: dict[str, Any], params: dict[str, int], gflops: float) -> float:
    """Output tokens/s with every matmul at `gflops` (see the module docstring)."""
    reqs = workload["requests"]
    out = sum(r["max_tokens"] for r in reqs)
    forward_tokens = computed_prompt_tokens(workload) + out - len(reqs)
    flops = 2 * params["body"] * forward_tokens + 2 * params["lm_head"] * out
    return out / (flops / (gflops * 1e9))


def bandwidth_floor_ms(params: dict[str, int], read_gbps: float) -> float:
    """ms per token at batch 1 if reading the fp32 weights were all it cost."""
    return 1000 * 4 * (params["body"] + params["lm_head"]) / (read_gbps * 1e9)


def machine_state() -> dict[str, Any]:
    """CPU flags and the load average now."""
    return {"cpu": cpu_flags(), "load_average": os.getloadavg()}
