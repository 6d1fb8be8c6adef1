"""Memory of the loaded weights: `LLM()` on the embedded SmolLM2 (fp32), one process.

Reports, after `LLM()` returns and again after one short greedy request:
- `ru_maxrss` (the process's peak RSS) and the current VmRSS / RssAnon / RssFile;
- `weight_bytes`: the distinct tensor storages reachable from the step model (parameters,
  prepacked oneDNN weights, fused copies; KV pools excluded), each counted once;
- `parameter_bytes`: the checkpoint's parameters (tied weights once), ~0.54 GB in fp32.
The KV pool is sized small (`--kv-gib`, allocated but not touched, so it barely shows in
RSS). Results are merged into benchmarks/results/weights_memory.json under `--label`, so a
before and an after run of the code sit side by side.

`--speed` adds a batch-1 A/B in the same process (latency workload prompt, greedy,
interleaved, medians of `--repeats`): `one_copy` (the loaded layout: every linear through its
packed weight, one row included) against `plain_for_one_row` (the old two-copy layout,
rebuilt by unpacking plain copies: one-row linears through `split_linear`) and
`plain_head_for_one_row` (packed layers, the LM head through `split_linear` on the plain
embedding at one row: what dropping the packed copy of a tied head would cost).

    python benchmarks/weights_memory.py --label after [--threads 2] [--speed]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams
from tandem.testing.weight_storage import reachable_weight_bytes

ROOT = Path(__file__).resolve().parent
MIB = 1 << 20


def _rss_mib() -> dict[str, float]:
    """Peak (ru_maxrss) and current RSS figures of this process, in MiB."""
    status = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            status[key] = int(value.split()[0]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"ru_maxrss_mib": peak, **{f"{k}_mib": v for k, v in status.items()}}


def _hf_parameter_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's tensors as stored (fp32 here; tied weights stored once)."""
    from safetensors import safe_open

    total = 0
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                t = f.get_slice(name)
                numel = 1
                for dim in t.get_shape():
                    numel *= dim
                total += numel * 4
    return total


def _set_layout(model: Any, name: str, plain: dict[int, Any]) -> None:
    """Point every `PackedLinear`'s one-row path at a plain weight or at none (packed)."""
    layer_linears = [lin for layer in model.fused.layers for lin in (layer.qkv, layer.o)]
    layer_linears += [lin for layer in model.fused.layers for lin in (layer.gate_up, layer.down)]
    for lin in layer_linears:
        lin.weight = plain[id(lin)] if name == "plain_for_one_row" else None
    head = model.lm_head
    head.weight = None if name == "one_copy" else plain[id(head)]


def batch1_ab(llm: LLM, model: Any, repeats: int, tokens: int) -> dict[str, Any]:
    """ms/token at batch 1 per layout, interleaved in this process (see the module doc)."""
    import statistics

    linears = [model.lm_head] + [
        lin
        for layer in model.fused.layers
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    plain = {id(lin): lin.dense_weight() for lin in linears}
    embed = model.model.get_input_embeddings().weight
    if model.model.lm_head.weight is embed:
        plain[id(model.lm_head)] = embed.detach()  # tied: the embedding is the plain head
    workload = json.loads((ROOT / "workloads" / "latency.json").read_text())
    prompt = workload["requests"][0]["prompt_token_ids"]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    names = ["one_copy", "plain_for_one_row", "plain_head_for_one_row"]
    ms: dict[str, list[float]] = {n: [] for n in names}
    outputs = set()
    llm.generate([prompt], params, use_tqdm=False)
    for _ in range(repeats):
        for name in names:
            _set_layout(model, name, plain)
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            m = out.metrics
            ms[name].append(1000 * (m.finished_time - m.first_token_time) / (tokens - 1))
            outputs.add(tuple(out.outputs[0].token_ids))
    _set_layout(model, "one_copy", plain)
    base = ms["plain_for_one_row"]
    return {
        "runs_ms_per_token": ms,
        "median_ms_per_token": {n: statistics.median(v) for n, v in ms.items()},
        "median_ratio_over_plain_for_one_row": {
            n: statistics.median(a / b for a, b in zip(v, base, strict=True)) for n, v in ms.items()
        },
        "same_tokens": len(outputs) == 1,
        "tokens": tokens,
        "load_average_after": os.getloadavg(),
    }


def measure(threads: int, kv_gib: float) -> tuple[dict[str, Any], LLM, Any]:
    torch.set_num_threads(threads)
    llm = LLM(
        async_scheduling=False,
        max_model_len=1024,
        kv_cache_memory_gib=kv_gib,
        worker_num_threads=threads,
    )
    model = llm.engine.executor.worker.model
    after_load = _rss_mib()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([list(range(100, 164))], params)
    after_generate = _rss_mib()
    weight_bytes = reachable_weight_bytes(model)
    param_bytes = _hf_parameter_bytes(str(llm.config.model.model))
    return (
        {
            "after_load": after_load,
            "after_generate": after_generate,
            "weight_bytes": weight_bytes,
            "parameter_bytes": param_bytes,
            "weight_over_parameter_bytes": weight_bytes / param_bytes,
            "kv_cache_memory_gib": kv_gib,
            "threads": threads,
            "load_average": os.getloadavg(),
        },
        llm,
        model,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="current")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-gib", type=float, default=0.25)
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", default=str(ROOT / "results" / "weights_memory.json"))
    args = parser.parse_args()
    result, llm, model = measure(args.threads, args.kv_gib)
    if args.speed:
        result["batch1"] = batch1_ab(llm, model, args.repeats, args.tokens)
        print(json.dumps(result["batch1"]["median_ratio_over_plain_for_one_row"]))
    out = Path(args.out)
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged[args.label] = result
    out.write_text(json.dumps(merged, indent=1) + "\n")
    print(
        f"{args.label}: weights {result['weight_bytes'] / MIB:.0f} MiB "
        f"({result['weight_over_parameter_bytes']:.2f}x the parameters), "
        f"RSS after load {result['after_load']['VmRSS_mib']:.0f} MiB, "
        f"peak {result['after_generate']['ru_maxrss_mib']:.0f} MiB"
    )


if __name__ == "__main__":
    main()
