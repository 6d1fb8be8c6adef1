"""bf16 on CPU vs transformers' bf16, on the embedded SmolLM2 (issue 16 item 3).

On the parity chats (the prompts of tests/model/test_model_parity.py), greedy:

- transformers bf16 `generate()` (the reference sequence) and tandem bf16 greedy
  (`LLM(dtype="bfloat16")`: bf16 weights and KV cache, float32 compute, the compiled decode
  kernel on the bf16 pools): exact-match positions, and where the first divergence falls;
- teacher-forced top-1 agreement: tandem's bf16 argmax at each position given the
  reference prefix (`tandem.testing.teacher_forcing`), vs the reference's own token;
- float32: tandem greedy == transformers float32 `generate()`, token for token.

Writes benchmarks/results/bf16_parity.json. One torch thread; about a minute.

    python benchmarks/bf16_parity.py [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from tandem.llm import LLM
from tandem.models.cpu_features import has_bf16_units
from tandem.models.cpu_kernels import paged_decode_kernel
from tandem.models.hf_model import HFStepModel
from tandem.models.model_files import resolve_model_dir
from tandem.schema.sampling_params import SamplingParams
from tandem.testing.teacher_forcing import teacher_forced_top1

ROOT = Path(__file__).resolve().parent
#: tests/model/test_model_parity.py's SmolLM2 chats.
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a long poem about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers."},
    ],
]
BLOCK_SIZE = 16
NUM_BLOCKS = 64


def hf_greedy(model_dir: Path, dtype: torch.dtype, prompts: list[list[int]], n: int) -> list:
    """transformers `generate()` greedy continuations, `n` tokens each (no early stop)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            seq = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(seq[0, len(prompt) :].tolist())
    return outs


def tandem_greedy(dtype: str, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy continuations) of tandem on the chats."""
    llm = LLM(
        model="default",
        dtype=dtype,
        num_kv_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_model_len=NUM_BLOCKS * BLOCK_SIZE,
        worker_num_threads=1,
        async_scheduling=False,
    )
    try:
        model = llm.engine.executor.worker.model
        if dtype == "bfloat16":
            assert model.kv_caches[0][0].dtype == torch.bfloat16
            assert model.decode_kernel is not None or paged_decode_kernel() is None
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        outs = llm.chat(CHATS, params, use_tqdm=False)
        return [list(o.prompt_token_ids) for o in outs], [
            list(o.outputs[0].token_ids) for o in outs
        ]
    finally:
        llm.engine.shutdown()


def exact_stats(got: list[list[int]], want: list[list[int]]) -> dict:
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    total = sum(len(w) for w in want)
    first = [
        next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        for g, w in zip(got, want, strict=True)
    ]
    return {"positions": total, "equal": same, "fraction": same / total, "first_divergence": first}


def teacher_forced(model_dir: Path, prompts: list[list[int]], refs: list[list[int]]) -> dict:
    model = HFStepModel(
        model_dir,
        torch.bfloat16,
        NUM_BLOCKS,
        BLOCK_SIZE,
        torch.device("cpu"),
        decode_kernel=paged_decode_kernel(),
    )
    top1 = [teacher_forced_top1(model, p, r) for p, r in zip(prompts, refs, strict=True)]
    stats = exact_stats(top1, refs)
    stats.pop("first_divergence")
    stats["disagreeing_positions"] = [
        [i for i, (a, b) in enumerate(zip(t, r, strict=True)) if a != b]
        for t, r in zip(top1, refs, strict=True)
    ]
    return stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.monotonic()
    model_dir = resolve_model_dir("default")
    prompts, bf16_out = tandem_greedy("bfloat16", args.tokens)
    ref_bf16 = hf_greedy(model_dir, torch.bfloat16, prompts, args.tokens)
    forced = teacher_forced(model_dir, prompts, ref_bf16)
    _, fp32_out = tandem_greedy("float32", args.tokens)
    ref_fp32 = hf_greedy(model_dir, torch.float32, prompts, args.tokens)
    result = {
        "model": model_dir.name,
        "tokens_per_prompt": args.tokens,
        "prompts": len(prompts),
        "bf16_units": has_bf16_units(),
        "bf16_greedy_exact": exact_stats(bf16_out, ref_bf16),
        "bf16_teacher_forced_top1": forced,
        "fp32_greedy_exact": exact_stats(fp32_out, ref_fp32),
        "fp32_identical": fp32_out == ref_fp32,
        "threads": 1,
        "seconds": round(time.monotonic() - began, 1),
    }
    out_path = ROOT / "results" / "bf16_parity.json"
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("bf16_units", "fp32_identical", "seconds")}))
    print("bf16 exact", result["bf16_greedy_exact"])
    print("bf16 teacher-forced", forced["fraction"], "load", os.getloadavg()[0])


if __name__ == "__main__":
    main()
