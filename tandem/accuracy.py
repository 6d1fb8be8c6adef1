"""Accuracy of weight quantizations against the unquantized model, teacher-forced.

A fixed text is tokenized once and fed in chunks as prompts (`prompt_logprobs=1`, one
generated token each). At every position after the first of a chunk the engine reports the
logprob of the true next token and its own top-1 token. For each quantization:

- `top1_agreement`: the fraction of positions whose top-1 token equals the baseline's
  (`quantization: none`: every weight in float, the model's own values dequantized);
- `perplexity`: exp(-mean logprob of the true tokens), and `perplexity_ratio` to the
  baseline's.

Quantization names are `model.quantization` values (`none`, `auto`, `int8`, `int4`,
`awq`, `gptq`), and `int8-gN` / `int4-gN` for `quantization_group_size: N` (`int8-g0`:
one scale per output channel). `tandem bench --accuracy` and
`benchmarks/quant_accuracy.py` both run `measure_accuracy`.
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from tandem.schema.config import ModelConfig

#: The baseline every quantization is compared with.
BASELINE = "none"
#: What `tandem bench --accuracy` compares by default.
DEFAULT_QUANTIZATIONS = ("none", "auto", "int8", "int4")
#: `model.quantization`'s values and `quantization_group_size`'s, from the config schema.
MODES: tuple[str, ...] = get_args(ModelConfig.model_fields["quantization"].annotation)
GROUP_SIZES: tuple[int, ...] = get_args(
    ModelConfig.model_fields["quantization_group_size"].annotation
)
#: The fixed text, in a checkout (`tests/data`); an installed package takes `text=`.
ACCURACY_TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "accuracy_text.txt"


def accuracy_text_path(path: str | Path | None = None) -> Path:
    """`path`, or the checkout's fixed text; ValueError naming `--text` when the file is
    missing (an installed package ships no tests: pass a text file there)."""
    chosen = Path(path) if path is not None else ACCURACY_TEXT
    if not chosen.is_file():
        hint = "" if path is not None else " (it ships with a checkout; pass --text PATH)"
        raise ValueError(f"--text: accuracy text {chosen} not found{hint}")
    return chosen


def quantization_settings(name: str) -> dict[str, Any]:
    """The `LLM(...)` keywords of a quantization name: `int4-g64` -> quantization int4 in
    groups of 64. ValueError naming `--quantizations` and the accepted names otherwise."""
    mode, _, group = name.partition("-g")
    groups = [g for g in GROUP_SIZES if g or mode == "int8"]
    if mode in MODES and not group:
        return {"quantization": mode}
    if mode in ("int8", "int4") and group.isdigit() and int(group) in groups:
        return {"quantization": mode, "quantization_group_size": int(group)}
    raise ValueError(
        f"--quantizations: {name!r} is not a quantization; expected one of "
        f"{', '.join(MODES)}, or int8-gN / int4-gN with N in "
        f"{', '.join(str(g) for g in GROUP_SIZES)} (0: int8 only)"
    )


@dataclass
class TeacherForced:
    """One quantization's run: the top-1 token and the true token's logprob at every
    scored position, and which weights the engine held quantized."""

    top1: list[int]
    logprobs: list[float]
    quantization: str | None


def _chunks(token_ids: list[int], chunk: int) -> list[list[int]]:
    """Prompts of `chunk` tokens (the last shorter); single-token tails are dropped."""
    pieces = [token_ids[i : i + chunk] for i in range(0, len(token_ids) - 1, chunk)]
    return [c for c in pieces if len(c) > 1]


def tokenize_text(model: str, text: str, settings: dict[str, Any]) -> list[int]:
    """The text's token ids by `model`'s tokenizer (ValueError where it has none)."""
    from tandem.config_resolution import resolve_config
    from tandem.models.model_files import load_tokenizer
    from tandem.stack_file import load_config

    resolved = resolve_config(load_config(None, model=model, **settings))
    tokenizer = load_tokenizer(Path(resolved.model.model))
    if tokenizer is None:
        raise ValueError(f"--model {model}: no tokenizer files to tokenize the accuracy text")
    return list(tokenizer(text)["input_ids"])


def teacher_forced(
    model: str, token_ids: list[int], chunk: int, settings: dict[str, Any]
) -> TeacherForced:
    """Run `model` with `settings` (LLM keywords) over `token_ids` in chunks of `chunk`."""
    from tandem import LLM, SamplingParams

    llm = LLM(model=model, **({"max_model_len": chunk + 8} | settings))
    try:
        pieces = _chunks(token_ids, chunk)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        prompts = [{"prompt_token_ids": c} for c in pieces]
        outs = llm.generate(prompts, params, use_tqdm=False)
        top1: list[int] = []
        logprobs: list[float] = []
        for tokens, out in zip(pieces, outs, strict=True):
            for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
                logprobs.append(entry[tokens[position]].logprob)
                top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
        described = llm.engine.executor.collective_rpc("describe")
        return TeacherForced(top1, logprobs, described[0].get("quantization"))
    finally:
        llm.shutdown()


def compare(runs: dict[str, TeacherForced]) -> dict[str, dict[str, Any]]:
    """Per quantization: agreement with and perplexity relative to `runs[BASELINE]`."""
    base = runs[BASELINE]
    base_ppl = math.exp(-sum(base.logprobs) / len(base.logprobs))
    results = {}
    for name, run in runs.items():
        ppl = math.exp(-sum(run.logprobs) / len(run.logprobs))
        agree = sum(a == b for a, b in zip(run.top1, base.top1, strict=True)) / len(run.top1)
        results[name] = {
            "quantization": run.quantization,
            "top1_agreement": round(agree, 5),
            "perplexity": round(ppl, 4),
            "perplexity_ratio": round(ppl / base_ppl, 5),
            "positions": len(run.top1),
        }
    return results


def measure_accuracy(
    model: str,
    quantizations: list[str],
    text: str | Path | None = None,
    chunk: int = 256,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The accuracy report of `quantizations` (the baseline `none` is added first where it
    is missing) on `text` (a path; default: the fixed text), each engine built with
    `overrides` (LLM keywords; `dtype` float32 unless given). Names are checked before any
    model loads (ValueError, `quantization_settings`)."""
    if chunk < 2:
        raise ValueError(f"--chunk: at least 2 tokens per prompt, got {chunk}")
    settings = {name: quantization_settings(name) for name in quantizations}
    names = [BASELINE] + [n for n in dict.fromkeys(quantizations) if n != BASELINE]
    path = accuracy_text_path(text)
    base = {"dtype": "float32"} | (overrides or {})
    token_ids = tokenize_text(model, path.read_text(), base)
    runs = {
        name: teacher_forced(model, token_ids, chunk, base | settings.get(name, {}))
        for name in names
    }
    return {
        "benchmark": "accuracy",
        "model": model,
        "text": str(path),
        "text_tokens": len(token_ids),
        "chunk_tokens": chunk,
        "baseline": BASELINE,
        "machine": platform.processor() or platform.machine(),
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
        "results": compare(runs),
    }


def summary_lines(report: dict[str, Any]) -> list[str]:
    """One line per quantization: agreement, perplexity and its ratio."""
    return [
        f"{name:10s} top-1 agreement {r['top1_agreement']:.4f}  perplexity "
        f"{r['perplexity']:.3f} ({r['perplexity_ratio']:.4f}x)  [{r['quantization']}]"
        for name, r in report["results"].items()
    ]
