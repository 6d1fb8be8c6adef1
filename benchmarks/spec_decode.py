"""Speculative decoding on the CPU: tokens/s with and without drafts, in one invocation.

Every engine runs in this process with the same torch thread count, one after the other:
for each repeat, for each batch size, for each method (interleaved, so load changes hit
all methods alike). Greedy, ignore_eos, 256 output tokens per request of
`benchmarks/workloads/spec_repetitive.json` (prompts that ask the model to repeat or
rewrite a passage). Reports per (method, batch): median output tokens/s, the ratio to no
speculation, and the acceptance (mean acceptance length = tokens per verify step, per-
position acceptance rate) of the timed runs. Also measures the n-gram drafter's cost: the
time of the `propose_drafts` hook per decode step of the default workload (64 requests,
~300-token histories; synchronous loop so every step is timed whole), as a percentage of
the step.

Run: python benchmarks/spec_decode.py [--methods none,ngram,eagle --eagle-model DIR]
Writes benchmarks/results/spec_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tandem import LLM, SamplingParams
from tandem.core import hookimpl
from tandem.core.worker.draft_context import DraftContext

ROOT = Path(__file__).resolve().parent.parent


def spec_config(method: str, args: argparse.Namespace) -> dict[str, Any] | None:
    if method == "none":
        return None
    if method == "ngram_adaptive":  # k from --k, off above --disable-by-batch-size
        return {
            **(spec_config("ngram", args) or {}),
            "disable_by_batch_size": args.disable_by_batch_size,
        }
    if method.startswith("ngram"):  # "ngram" uses --k; "ngram8" uses k = 8
        return {
            "method": "ngram",
            "num_speculative_tokens": int(method[5:] or args.k),
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
        }
    if method == "eagle":
        if not args.eagle_model:
            raise SystemExit("--methods eagle needs --eagle-model DIR (the trained head)")
        return {
            "method": "eagle",
            "num_speculative_tokens": args.eagle_k,
            "model": args.eagle_model,
        }
    raise SystemExit(f"unknown method {method!r}")


def counters(llm: LLM) -> tuple[int, int, int, list[int]]:
    """(verify steps, drafts, accepted, accepted per position) so far."""
    m = llm.spec_decode_metrics()
    if m is None:
        return 0, 0, 0, []
    steps = int(m["num_verify_steps"])
    per_position = [round(r * steps) for r in m["acceptance_rate_per_position"]]
    return steps, int(m["num_draft_tokens"]), int(m["num_accepted_tokens"]), per_position


def timed_run(llm: LLM, requests: list[dict[str, Any]]) -> dict[str, Any]:
    params = [
        SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests
    ]
    before = counters(llm)
    start = time.perf_counter()
    outs = llm.generate([r["prompt_token_ids"] for r in requests], params)
    elapsed = time.perf_counter() - start
    after = counters(llm)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = after[0] - before[0]
    per_position = [a - (before[3][i] if i < len(before[3]) else 0) for i, a in enumerate(after[3])]
    return {
        "output_tokens": tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "verify_steps": steps,
        "draft_tokens": after[1] - before[1],
        "accepted_tokens": after[2] - before[2],
        "accepted_per_position": per_position,
    }


class DraftTimer:
    """Worker-side hookwrapper: wall time of every `propose_drafts` call, with the number
    of requests that sampled in that step."""

    def __init__(self) -> None:
        #: (seconds, requests that sampled, engine step index) per call
        self.calls: list[tuple[float, int, int]] = []
        self.step = -1

    @hookimpl(hookwrapper=True)
    def propose_drafts(self, context: DraftContext):  # noqa: ANN201
        start = time.perf_counter()
        yield
        sampled = sum(1 for s in context.sampled_token_ids if s)
        self.calls.append((time.perf_counter() - start, sampled, self.step))


def drafting_cost(args: argparse.Namespace) -> dict[str, Any]:
    """n-gram drafting time per decode step on the default workload, sync loop."""
    workload = json.loads((ROOT / "benchmarks" / "workloads" / "default.json").read_text())
    requests = workload["requests"]
    llm = LLM(
        model=args.model,
        async_scheduling=False,
        speculative_config=spec_config("ngram", args),
        worker_num_threads=args.threads,
        num_kv_blocks=max(args.kv_blocks, 2048),
        max_model_len=args.max_model_len,
    )
    timer = DraftTimer()
    llm.engine.executor.worker.plugin_manager.register(timer, name="draft-timer")  # type: ignore[attr-defined]
    step_times: list[float] = []
    engine = llm.engine
    inner = engine.step_fn

    def timed_step() -> Any:
        timer.step = len(step_times)
        start = time.perf_counter()
        result = inner()
        step_times.append(time.perf_counter() - start)
        return result

    engine.step_fn = timed_step  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=args.cost_tokens, ignore_eos=True)
    llm.generate([r["prompt_token_ids"] for r in requests], params)
    llm.shutdown()
    n = len(requests)
    # Steps in which every request sampled (no prefill left): decode and verify steps.
    full = [(d, step) for d, sampled, step in timer.calls if sampled == n]
    draft_ms = [d * 1e3 for d, _ in full]
    step_ms = [step_times[step] * 1e3 for _, step in full]
    histories = [len(r["prompt_token_ids"]) + args.cost_tokens // 2 for r in requests]
    return {
        "workload": f"default ({len(requests)} requests), max_tokens {args.cost_tokens}",
        "mean_history_tokens": statistics.mean(histories),
        "decode_steps_measured": len(full),
        "draft_ms_median": statistics.median(draft_ms) if draft_ms else None,
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "draft_percent_of_step": (
            100 * statistics.median(draft_ms) / statistics.median(step_ms) if full else None
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--workload", default=str(ROOT / "benchmarks" / "workloads" / "spec_repetitive.json")
    )
    parser.add_argument(
        "--methods",
        default="none,ngram",
        help="comma list of none, ngram (k from --k), ngramK (k = K, e.g. ngram8), "
        "ngram_adaptive (k from --k, speculative.disable_by_batch_size from "
        "--disable-by-batch-size), eagle",
    )
    parser.add_argument("--disable-by-batch-size", type=int, default=4)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--k", type=int, default=4, help="n-gram num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--eagle-model", help="EAGLE head directory")
    parser.add_argument("--eagle-k", type=int, default=3)
    parser.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--max-tokens", type=int, help="override the workload's max_tokens")
    parser.add_argument("--kv-blocks", type=int, default=1024, help="KV pool per engine")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--cost-tokens", type=int, default=64, help="0 skips the drafting cost")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_decode.json"))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    workload = json.loads(Path(args.workload).read_text())
    requests = workload["requests"]
    if args.max_tokens:
        requests = [{**r, "max_tokens": args.max_tokens} for r in requests]
    methods = args.methods.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    async_flag = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    engines = {}
    for method in methods:
        llm = LLM(
            model=args.model,
            speculative_config=spec_config(method, args),
            async_scheduling=async_flag,
            worker_num_threads=args.threads,
            num_kv_blocks=args.kv_blocks,  # every engine stays alive: a small pool each
            max_model_len=args.max_model_len,
        )
        llm.generate([requests[0]["prompt_token_ids"]], SamplingParams(temperature=0, max_tokens=8))
        engines[method] = llm
    runs: dict[str, list[dict[str, Any]]] = {f"{m}@{b}": [] for m in methods for b in batches}
    for rep in range(args.repeats):
        for batch in batches:
            chosen = [requests[(rep * batch + i) % len(requests)] for i in range(batch)]
            for method in methods:
                result = timed_run(engines[method], chosen)
                runs[f"{method}@{batch}"].append(result)
                print(
                    f"rep {rep} batch {batch:2d} {method:6s} "
                    f"{result['tokens_per_s']:7.1f} tok/s  accepted {result['accepted_tokens']}",
                    flush=True,
                )
    configs = {
        m: engines[m].config.model_dump(include={"speculative", "scheduler"}) for m in methods
    }
    for llm in engines.values():
        llm.shutdown()

    summary: dict[str, Any] = {}
    for batch in batches:
        base = (
            statistics.median(r["tokens_per_s"] for r in runs[f"none@{batch}"])
            if "none" in methods
            else None
        )
        reference_ids = [r["token_ids"] for r in runs.get(f"none@{batch}", [])]
        for method in methods:
            rs = runs[f"{method}@{batch}"]
            median = statistics.median(r["tokens_per_s"] for r in rs)
            steps = sum(r["verify_steps"] for r in rs)
            accepted = sum(r["accepted_tokens"] for r in rs)
            k = max((len(r["accepted_per_position"]) for r in rs), default=0)
            per_position = [
                sum(
                    r["accepted_per_position"][j] for r in rs if j < len(r["accepted_per_position"])
                )
                / steps
                if steps
                else 0.0
                for j in range(k)
            ]
            summary[f"{method}@{batch}"] = {
                "method": method,
                "batch": batch,
                "tokens_per_s": [round(r["tokens_per_s"], 2) for r in rs],
                "tokens_per_s_median": median,
                "ratio_to_none": median / base if base else None,
                "mean_acceptance_length": 1 + accepted / steps if steps else None,
                "acceptance_rate_per_position": per_position,
                "draft_tokens": sum(r["draft_tokens"] for r in rs),
                "accepted_tokens": accepted,
                "same_tokens_as_none": [r["token_ids"] for r in rs] == reference_ids
                if reference_ids
                else None,
            }
    cost = drafting_cost(args) if args.cost_tokens and "ngram" in methods else None
    result = {
        "command": "python benchmarks/spec_decode.py "
        + " ".join(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if v is not None),
        "torch_threads": torch.get_num_threads(),
        "worker_threads": args.threads,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "workload": workload["name"],
        "num_requests_in_workload": len(requests),
        "max_tokens": requests[0]["max_tokens"],
        "configs": configs,
        "summary": summary,
        "ngram_drafting_cost": cost,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "configs"}, indent=2))


if __name__ == "__main__":
    main()
