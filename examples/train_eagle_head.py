"""Train an EAGLE draft head for the embedded SmolLM2 by self-distillation, on the CPU.

No EAGLE weights can be downloaded here, so the head learns from the target itself:

1. prompts: built from templates x subjects (no downloads); the evaluation prompts use
   subjects the training set never sees;
2. data: the target's own greedy generations for them, with tandem's engine;
3. features: one transformers forward over each prompt + generation, keeping the last
   hidden states (after the final norm) -- what the runner hands the drafter;
4. training (AdamW, a time budget): at position p the head reads (hidden p, token p+1)
   and must (a) predict the target's next-token distribution at p+1 through the shared LM
   head (soft cross-entropy) and (b) regress the target's hidden state at p+1 (smooth L1).
   A second, unrolled pass feeds the head its own features instead of the target's, as
   drafting does after the first draft;
5. evaluation: the engine with `speculative_config={"method": "eagle", ...}` on the
   held-out prompts, against the same engine without speculation (outputs must be equal):
   mean acceptance length, per-position acceptance and the wall-clock speedup, written to
   `benchmarks/results/eagle_head.json`.

    python examples/train_eagle_head.py                   # ~15-20 min on 2 busy cores
    python examples/train_eagle_head.py --minutes 3 --num-prompts 48   # a quick try

The head goes to `$TANDEM_CACHE/eagle/smollm2-135m-instruct` (default
`~/.cache/tandem/...`), which examples/stacks/eagle-*.yaml point at.

The steps live in `eagle_head_training.py` beside this script; this file is the command
line and the report.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from eagle_head_training import (
    HELD_OUT_SUBJECTS,
    SUBJECTS,
    build_prompts,
    chat_ids,
    default_output_dir,
    evaluate,
    generate,
    make_llm,
    target_features,
    train,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="training time budget")
    parser.add_argument("--num-prompts", type=int, default=448, help="training prompts")
    parser.add_argument("--max-tokens", type=int, default=128, help="generation length")
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--eval-max-tokens", type=int, default=96)
    parser.add_argument("--batch1-prompts", type=int, default=4, help="prompts run one by one")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens at evaluation")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="checkpoint directory")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results/eagle_head.json"))
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument(
        "--draft-vocab", type=int, default=8192, help="draft vocabulary size (0: all used)"
    )
    parser.add_argument(
        "--data", type=Path, default=None, help="generations + features cache (.pt)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out_dir = args.out or default_output_dir()
    wall = time.perf_counter()

    from transformers import AutoModelForCausalLM

    from tandem.models.model_files import load_tokenizer, resolve_model_dir
    from tandem.spec_decode.eagle_head import save_eagle_head

    model_dir = resolve_model_dir("default")
    tokenizer = load_tokenizer(model_dir)
    train_prompts = build_prompts(SUBJECTS, args.num_prompts, args.seed)
    eval_prompts = build_prompts(HELD_OUT_SUBJECTS, args.eval_prompts, args.seed + 1)
    train_ids = chat_ids(tokenizer, train_prompts)
    eval_ids = chat_ids(tokenizer, eval_prompts)

    data_path = args.data or (
        default_output_dir().parent / f"data-{args.num_prompts}x{args.max_tokens}-s{args.seed}.pt"
    )
    target = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if data_path.is_file():
        data = torch.load(data_path)
        print(f"loaded generations and features from {data_path}", flush=True)
    else:
        t = time.perf_counter()
        llm = make_llm()
        generations, _ = generate(llm, train_ids, args.max_tokens)
        llm.engine.shutdown()
        del llm
        sequences = [p + g for p, g in zip(train_ids, generations, strict=True)]
        gen_seconds = time.perf_counter() - t
        print(f"generated {sum(map(len, generations))} tokens in {gen_seconds:.0f}s", flush=True)
        t = time.perf_counter()
        features = target_features(target, sequences)
        feat_seconds = time.perf_counter() - t
        print(f"target features in {feat_seconds:.0f}s", flush=True)
        data = {
            "sequences": sequences,
            "generated_tokens": sum(map(len, generations)),
            "features": features,
            "generation_seconds": gen_seconds,
            "feature_seconds": feat_seconds,
        }
        data_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, data_path)
    sequences, features = data["sequences"], data["features"]
    num_tokens = sum(len(s) for s in sequences)

    t = time.perf_counter()
    head, stats = train(
        target,
        sequences,
        features,
        args.minutes,
        args.batch_size,
        args.lr,
        args.seed,
        args.draft_vocab,
    )
    train_seconds = time.perf_counter() - t
    save_eagle_head(head, out_dir)
    print(f"trained {stats['steps']} steps in {train_seconds:.0f}s; saved to {out_dir}", flush=True)
    del target, features

    report: dict[str, Any] = {
        "command": "python examples/train_eagle_head.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k in ("minutes", "num_prompts", "max_tokens", "k", "threads", "draft_vocab")
        ),
        "head_dir": str(out_dir),
        "torch_threads": args.threads,
        "load_average_start": os.getloadavg(),
        "data": {
            "train_prompts": len(train_ids),
            "train_tokens": num_tokens,
            "generated_tokens": data["generated_tokens"],
            "generation_seconds": round(data["generation_seconds"], 1),
            "feature_seconds": round(data["feature_seconds"], 1),
            "data_cache": str(data_path),
        },
        "training": {
            "seconds": round(train_seconds, 1),
            "steps": stats["steps"],
            "draft_vocab": stats["draft_vocab"],
            "draft_vocab_token_coverage": stats["draft_vocab_token_coverage"],
            "tokens_seen": stats["tokens_seen"],
            "final": stats["log"][-1] if stats["log"] else None,
            "log": stats["log"],
        },
    }
    if not args.skip_eval:
        report["evaluation"] = {
            "eval_prompts": len(eval_ids),
            "max_tokens": args.eval_max_tokens,
            "num_speculative_tokens": args.k,
            **evaluate(out_dir, eval_ids, args.eval_max_tokens, args.k, args.batch1_prompts),
        }
        report["load_average_end"] = os.getloadavg()
        ev = report["evaluation"][f"batch_{len(eval_ids)}"]
        ev1 = report["evaluation"]["batch_1"]
        print(
            f"acceptance length {ev['eagle']['mean_acceptance_length']:.3f} "
            f"(per position {ev['eagle']['acceptance_rate_per_position']}), "
            f"speedup {ev['speedup']}x at batch {len(eval_ids)}, {ev1['speedup']}x at batch 1 "
            f"(acceptance length {ev1['eagle']['mean_acceptance_length']:.3f}), outputs "
            f"equal: {ev['outputs_equal'] and ev1['outputs_equal']}",
            flush=True,
        )
    report["wall_seconds"] = round(time.perf_counter() - wall, 1)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.results}", flush=True)


if __name__ == "__main__":
    main()
