"""tandem `LLM` vs transformers `generate()` on a random DiffusionGemma, batch 1 and 16.

Both sides run in this process on one torch thread, on the same checkpoint, prompts and
denoising schedule (fixed `max_denoising_steps`, transformers' defaults otherwise), EOS
ignored so every request commits exactly `max_tokens`. Per batch size the runs alternate
(tandem, transformers, tandem, ...) after one warm-up each; the figure is the median of
the per-pair ratios of committed tokens/s. A batch of B means B requests in flight:
tandem gets B prompts in one `generate` call with `max_num_seqs=B` (continuous batching:
a request whose canvas commits leaves the decoder batch); transformers gets them as one
left-padded `generate` call with an attention mask (its batched mode: every row runs until
the slowest row's canvas stops and positions ignore the padding). Batch 1: one request per
call, in a loop, on both sides.

tandem's diffusion stats (`engine.stats()["diffusion"]`, per run) give denoising steps per
canvas, committed tokens per engine step and tokens per forward; transformers' own
`tokens_per_forward` is recorded next to them. One run per side at the largest batch is
profiled (cProfile): the share of time in the model's forward passes and the top functions.

    python benchmarks/diffusion_compare.py [--repeats 3] [--out benchmarks/results/diffusion_compare.json]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from machine_roofline import cpu_flags  # noqa: E402

#: The benchmark's model: larger than the parity configs so the forward dominates
#: (hidden 256, 4 layers alternating sliding/full, 4 experts top-2, vocabulary 2048).
BENCH_TEXT: dict[str, Any] = {
    "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "num_experts": 4,
    "top_k_experts": 2, "moe_intermediate_size": 256, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2,
}  # fmt: skip
BENCH_CANVAS = 16
#: The schedules both sides run (transformers' defaults for the rest: entropy bound 0.1).
#: `fixed`: the checkpoint's stopping thresholds, which random weights never meet (mean
#: entropy stays far above 0.005), so every canvas takes all `max_denoising_steps`.
#: `adaptive`: no stability bar and a confidence bar (mean entropy of the temperature-scaled
#: logits < 5.0) that this model crosses as the temperature schedule cools, at a step that
#: differs per request and canvas (about 4 of 8 on average): requests commit at different
#: steps, which is where continuous batching (a committed canvas leaves the decoder batch)
#: differs from transformers' lockstep batch (every row runs until the slowest stops).
SCHEDULES: dict[str, dict[str, Any]] = {
    "fixed": {
        "max_denoising_steps": 8, "t_min": 0.4, "t_max": 0.8,
        "stability_threshold": 1, "confidence_threshold": 0.005,
    },
    "adaptive": {
        "max_denoising_steps": 8, "t_min": 0.4, "t_max": 0.8,
        "stability_threshold": 0, "confidence_threshold": 5.0,
    },
}  # fmt: skip
RESULT = ROOT / "results" / "diffusion_compare.json"


def build_checkpoint(path: Path, text: dict[str, Any], canvas: int) -> Path:
    """Save a random DiffusionGemma (tandem.testing's tiny builder) under `path`."""
    from tandem.testing.tiny_diffusion_gemma import tiny_diffusion_gemma

    tiny_diffusion_gemma(text, canvas).save_pretrained(path)
    return path


def make_prompts(count: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """`count` random prompts of lengths in `lengths` (ids 3..vocab-1: no pad/BOS/EOS)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def tandem_llm(path: Path, batch: int, schedule: dict[str, Any], max_model_len: int) -> Any:
    """tandem's engine on the checkpoint: `max_num_seqs=batch`, one worker thread."""
    from tandem import LLM

    return LLM(
        model=str(path),
        max_num_seqs=batch,
        max_model_len=max_model_len,
        worker_num_threads=1,
        diffusion=schedule,
    )


def _diffusion_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    keys = ("denoising_steps", "commits", "committed_tokens", "engine_steps")
    d = {k: after[k] - before.get(k, 0) for k in keys}
    return {
        "denoising_steps_per_canvas": d["denoising_steps"] / max(d["commits"], 1),
        "committed_tokens_per_step": d["committed_tokens"] / max(d["engine_steps"], 1),
        "tokens_per_forward": d["committed_tokens"] / max(d["denoising_steps"], 1),
    }


def run_tandem(llm: Any, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, Any]:
    """Committed tokens/s of `prompts`, `batch` per `generate` call, and the run's stats."""
    from tandem import SamplingParams

    before = llm.engine.stats().get("diffusion") or {}
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        params = [
            SamplingParams(max_tokens=max_tokens, seed=i + j, ignore_eos=True)
            for j in range(len(chunk))
        ]
        for out in llm.generate(chunk, params, use_tqdm=False):
            tokens += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    stats = _diffusion_delta(before, llm.engine.stats()["diffusion"])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, **stats}


def hf_generate(
    model: Any, chunk: list[list[int]], max_tokens: int, schedule: dict[str, Any]
) -> tuple[int, float]:
    """One transformers `generate()` on `chunk`, left-padded with an attention mask when
    it holds more than one prompt. Returns (committed tokens, mean tokens per forward)."""
    width = max(len(p) for p in chunk)
    pad = model.config.get_text_config().pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
    kwargs: dict[str, Any] = {"attention_mask": mask} if len(chunk) > 1 else {}
    out = model.generate(ids, max_new_tokens=max_tokens, eos_token_id=None, **schedule, **kwargs)
    generated = out.sequences.shape[1] - width
    return len(chunk) * min(generated, max_tokens), float(out.tokens_per_forward.float().mean())


def run_hf(
    model: Any, prompts: list[list[int]], batch: int, max_tokens: int, schedule: dict[str, Any]
) -> dict[str, Any]:
    """transformers' committed tokens/s on `prompts`, `batch` rows per `generate()`."""
    tokens, per_forward = 0, []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            torch.manual_seed(i)
            n, tpf = hf_generate(model, prompts[i : i + batch], max_tokens, schedule)
            tokens, per_forward = tokens + n, [*per_forward, tpf]
    seconds = time.perf_counter() - start
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tokens_per_forward": statistics.mean(per_forward),
    }


#: Own-time groups of the profile, by the torch call's name: where a run's time goes.
OWN_TIME_GROUPS: dict[str, tuple[str, ...]] = {
    "matmul": ("linear", "matmul", "_grouped_mm", "bmm", "mm"),
    "attention": ("scaled_dot_product_attention",),
    "kv_copies": ("index_select", "masked_fill", "cat", "reshape", "contiguous"),
    "sampling_draws": ("multinomial", "randint"),
}


def _group_of(name: str) -> str | None:
    for group, calls in OWN_TIME_GROUPS.items():
        if any(f"method {c}" in name or f"method '{c}'" in name or f".{c}>" in name for c in calls):
            return group
    return None


def _code_key(fn: Callable[..., Any]) -> tuple[str, int, str]:
    code = inspect.unwrap(fn).__code__
    return (code.co_filename, code.co_firstlineno, code.co_name)


def profile(fn: Callable[[], Any], forwards: list[Callable[..., Any]], top: int = 10) -> dict:
    """cProfile one call of `fn`: total seconds, the share spent under `forwards` (the
    model's forward passes; they must not call one another), own time summed per
    `OWN_TIME_GROUPS` group and the `top` functions by own time."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    rows = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = max(sum(row[2] for row in rows.values()), 1e-9)
    forward = sum(rows[key][3] for key in map(_code_key, forwards) if key in rows)
    by_own = sorted(rows.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    groups = dict.fromkeys(OWN_TIME_GROUPS, 0.0)
    for (_, _, name), row in rows.items():
        group = _group_of(name)
        if group is not None:
            groups[group] += row[2]
    return {
        "seconds": total,
        "forward_share": min(forward / total, 1.0),
        "own_s_by_group": {k: round(v, 4) for k, v in groups.items()},
        "top_own_time": [
            {"function": f"{Path(file).name}:{line}:{name}", "own_s": round(row[2], 4)}
            for (file, line, name), row in by_own
        ],
    }


def compare_batch(
    llm: Any,
    hf: Any,
    prompts: list[list[int]],
    batch: int,
    max_tokens: int,
    repeats: int,
    schedule: dict[str, Any],
) -> dict[str, Any]:
    """Alternating runs at one batch size after a warm-up each; medians and the ratio
    (`llm` must run `schedule`)."""
    run_tandem(llm, prompts[:batch], batch, max_tokens)  # warm-up
    run_hf(hf, prompts[:batch], batch, max_tokens, schedule)
    pairs = []
    for _ in range(repeats):
        torch.set_num_threads(1)
        ours = run_tandem(llm, prompts, batch, max_tokens)
        torch.set_num_threads(1)
        theirs = run_hf(hf, prompts, batch, max_tokens, schedule)
        pairs.append((ours, theirs))
    ratios = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in pairs]

    def med(side: int, key: str) -> float:
        return statistics.median(pair[side][key] for pair in pairs)

    return {
        "batch": batch,
        "requests": len(prompts),
        "committed_tokens_per_run": pairs[0][0]["tokens"],
        "tandem_tokens_per_s": med(0, "tokens_per_s"),
        "transformers_tokens_per_s": med(1, "tokens_per_s"),
        "ratio_tandem_over_transformers": statistics.median(ratios),
        "ratios": ratios,
        "tandem_denoising_steps_per_canvas": med(0, "denoising_steps_per_canvas"),
        "tandem_committed_tokens_per_step": med(0, "committed_tokens_per_step"),
        "tandem_tokens_per_forward": med(0, "tokens_per_forward"),
        "transformers_tokens_per_forward": med(1, "tokens_per_forward"),
    }


def profile_batch(
    llm: Any,
    hf: Any,
    prompts: list[list[int]],
    batch: int,
    max_tokens: int,
    schedule: dict[str, Any],
) -> dict[str, Any]:
    """Where one run's time goes on each side (see `profile`): tandem's forwards are
    `DiffusionGemmaModel.encode` / `denoise`; transformers' the encoder's and the
    decoder's (`DiffusionGemmaForBlockDiffusion.forward`) forward calls."""
    from tandem.models.diffusion_gemma import DiffusionGemmaModel

    ours = [DiffusionGemmaModel.encode, DiffusionGemmaModel.denoise]
    theirs = [type(hf).forward, type(hf.model.encoder).forward]
    return {
        "tandem": profile(lambda: run_tandem(llm, prompts, batch, max_tokens), ours),
        "transformers": profile(lambda: run_hf(hf, prompts, batch, max_tokens, schedule), theirs),
    }


def compare(
    path: Path,
    batches: tuple[int, ...],
    requests: dict[int, int],
    prompt_lengths: tuple[int, int],
    max_tokens: int,
    repeats: int,
    schedules: dict[str, dict[str, Any]] = SCHEDULES,
    profile_runs: bool = True,
) -> dict[str, Any]:
    """Every schedule and batch size on the checkpoint at `path`; the JSON body (without
    machine). The largest batch of each schedule is profiled."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.set_num_threads(1)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(path)).eval()
    vocab = hf.config.get_text_config().vocab_size
    max_model_len = prompt_lengths[1] + max_tokens + hf.config.canvas_length
    results, profiles, settings = [], {}, {}
    for name, schedule in schedules.items():
        for batch in batches:
            prompts = make_prompts(requests[batch], prompt_lengths, vocab, seed=batch)
            llm = tandem_llm(path, batch, schedule, max_model_len)
            try:
                row = compare_batch(llm, hf, prompts, batch, max_tokens, repeats, schedule)
                results.append({"schedule": name, **row})
                if profile_runs and batch == max(batches):
                    key = f"{name}/batch{batch}"
                    profiles[key] = profile_batch(llm, hf, prompts, batch, max_tokens, schedule)
                settings = {
                    "async_scheduling": llm.config.scheduler.async_scheduling,
                    "executor": llm.config.parallel.executor,
                    "block_size": llm.config.cache.block_size,
                }
            finally:
                llm.shutdown()
    return {"results": results, "profiles": profiles, "tandem_settings": settings}


def machine() -> dict[str, Any]:
    """CPU model and vector flags (lscpu), the load average, torch threads."""
    return {
        "cpu": cpu_flags(),
        "load_average": list(os.getloadavg()),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def run_benchmark(
    text: dict[str, Any],
    canvas: int,
    batches: tuple[int, ...],
    requests: dict[int, int],
    prompt_lengths: tuple[int, int],
    max_tokens: int,
    repeats: int,
    schedules: dict[str, dict[str, Any]] = SCHEDULES,
) -> dict[str, Any]:
    """The whole report: a random checkpoint of `text` / `canvas` in a temporary
    directory, `compare` on it, the model, schedules and machine."""
    start = time.perf_counter()
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp), text, canvas)
        body = compare(path, batches, requests, prompt_lengths, max_tokens, repeats, schedules)
    return {
        "model": {"text_config": text, "canvas_length": canvas, "random": True},
        "schedules": schedules,
        "max_tokens": max_tokens,
        "prompt_lengths": list(prompt_lengths),
        "repeats": repeats,
        "transformers_batching": "one left-padded generate() per batch (attention_mask)",
        **body,
        "machine": {**machine(), "load_average_before": load_before},
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-batch1", type=int, default=4)
    parser.add_argument("--requests-batch16", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    report = {
        "command": "python benchmarks/diffusion_compare.py " + " ".join(sys.argv[1:]),
        **run_benchmark(
            BENCH_TEXT,
            BENCH_CANVAS,
            batches=(1, 16),
            requests={1: args.requests_batch1, 16: args.requests_batch16},
            prompt_lengths=(16, 64),
            max_tokens=args.max_tokens,
            repeats=args.repeats,
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for row in report["results"]:
        print(
            f"{row['schedule']} batch {row['batch']}: tandem "
            f"{row['tandem_tokens_per_s']:.1f} tok/s, transformers "
            f"{row['transformers_tokens_per_s']:.1f} tok/s, "
            f"ratio {row['ratio_tandem_over_transformers']:.2f}"
        )
    print(args.out)


if __name__ == "__main__":
    main()
