"""Structured output costs: the per-step grammar bitmask, and what deferred sampling costs
a mixed batch under async scheduling.

1. Bitmask: 32 JSON requests (four schemas) on the grammar plugin alone, with each backend.
   Each step builds the batch bitmask (`grammar_bitmask`), then every request accepts the
   next token of a valid document (`update_from_output`); medians over the steps.
2. Deferral: SmolLM2 on the worker-process executor, 32 requests of 64 output tokens, with
   0% and 25% of them JSON-constrained (a schema whose documents outlast 64 tokens, so the
   constrained requests run for the whole batch), sync and async, alternating, median of
   `--repeats`. Under async a step with a constrained request that still has placeholders
   defers its sampling until the previous step's tokens are in, so the whole batch loses
   the overlap.

    python benchmarks/structured_output.py [--repeats 3] [--threads 1]

Writes benchmarks/results/structured_output.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Address(BaseModel):
    street: str
    city: str
    zip: str = Field(pattern=r"[0-9]{5}")


class Customer(BaseModel):
    name: str
    age: int
    address: Address
    tier: Literal["free", "pro", "enterprise"]


class Line(BaseModel):
    sku: str
    quantity: int
    price: float


class Order(BaseModel):
    order_id: int
    customer: Customer
    lines: list[Line]
    status: Literal["pending", "shipped", "delivered"]


class Event(BaseModel):
    title: str
    year: int
    tags: list[str]
    confirmed: bool


SCHEMAS: list[type[BaseModel]] = [Customer, Order, Event, Address]


def documents() -> list[str]:
    """One valid compact document per schema (the token streams the matchers walk)."""
    address = Address(street="12 Rue de Rivoli", city="Paris", zip="75001")
    customer = Customer(name="Ada Lovelace", age=36, address=address, tier="pro")
    lines = [Line(sku=f"SKU-{i}", quantity=i + 1, price=9.5 * (i + 1)) for i in range(3)]
    order = Order(order_id=123456, customer=customer, lines=lines, status="shipped")
    event = Event(title="Launch", year=2024, tags=["space", "rocket", "moon"], confirmed=True)
    return [m.model_dump_json() for m in (customer, order, event, address)]


def bitmask_benchmark(backend: str, num_requests: int) -> dict[str, Any]:
    from tandem import SamplingParams
    from tandem.core.model_runner_output import ModelRunnerOutput
    from tandem.core.request import Request
    from tandem.core.scheduler_output import SchedulerOutput
    from tandem.models.model_files import load_hf_config, load_tokenizer, resolve_model_dir
    from tandem.schema.config import EngineConfig, ModelConfig
    from tandem.structured_output.manager import StructuredOutputManager

    model_dir = resolve_model_dir("default")
    hf = load_hf_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    config = EngineConfig(
        model=ModelConfig(
            model=str(model_dir), vocab_size=hf.vocab_size, eos_token_id=hf.eos_token_id
        )
    )
    manager = StructuredOutputManager(
        config, StructuredOutputManager.Options(backend=backend, max_compile_workers=1)
    )
    docs = [tokenizer.encode(d) for d in documents()]
    requests = []
    started = time.perf_counter()
    for i in range(num_requests):
        request = Request(
            request_id=str(i),
            prompt_token_ids=[1],
            sampling_params=SamplingParams(structured_outputs={"json": SCHEMAS[i % 4]}),
            eos_token_id=hf.eos_token_id,
        )
        manager.add_request(request)
        requests.append(request)
    while manager.requests_not_ready():
        manager.poll_finished_requests()
        time.sleep(0.001)
    compile_s = time.perf_counter() - started
    ids = [r.request_id for r in requests]
    so = SchedulerOutput(
        step_id=0, num_scheduled_tokens=dict.fromkeys(ids, 1), structured_output_request_ids=ids
    )
    fill_ms, accept_ms = [], []
    num_steps = min(len(d) for d in docs)
    for step in range(num_steps):
        t0 = time.perf_counter()
        bitmask = manager.grammar_bitmask(so)
        t1 = time.perf_counter()
        assert bitmask is not None and bitmask.shape[0] == num_requests
        for i, request in enumerate(requests):
            request.all_token_ids.append(docs[i % 4][step])
        manager.update_from_output(so, ModelRunnerOutput())
        t2 = time.perf_counter()
        fill_ms.append((t1 - t0) * 1e3)
        accept_ms.append((t2 - t1) * 1e3)
    assert manager.poll_finished_requests() is None  # every token was accepted
    return {
        "backend": backend,
        "num_requests": num_requests,
        "num_steps": num_steps,
        "ready_s_backend_init_and_4_compiles": round(compile_s, 3),
        "bitmask_ms_median": round(statistics.median(fill_ms), 3),
        "bitmask_ms_p90": round(sorted(fill_ms)[int(0.9 * len(fill_ms))], 3),
        "accept_ms_median": round(statistics.median(accept_ms), 3),
    }


def mixed_batch_run(llm: Any, constrained_fraction: float, num_requests: int) -> dict[str, Any]:
    from tandem import SamplingParams

    prompts = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write order number {i} as JSON with three lines."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(num_requests)
    ]
    num_constrained = round(constrained_fraction * num_requests)
    step = num_requests // num_constrained if num_constrained else 1
    constrained = set(range(0, num_requests, step)[:num_constrained])
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=64,
            ignore_eos=i not in constrained,
            structured_outputs={"json": Order} if i in constrained else None,
        )
        for i in range(num_requests)
    ]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = [len(o.outputs[0].token_ids) for o in outputs]
    free = sum(t for i, t in enumerate(tokens) if i not in constrained)
    return {
        "seconds": elapsed,
        "output_tokens_per_s": sum(tokens) / elapsed,
        "unconstrained_tokens_per_s": free / elapsed,
        # What one unconstrained request sees: its own decode rate in the mixed batch.
        "unconstrained_tokens_per_s_per_request": free
        / elapsed
        / (num_requests - len(constrained)),
        "num_constrained": len(constrained),
        "constrained_tokens": sum(tokens) - free,
    }


def deferral_benchmark(repeats: int, threads: int, num_requests: int) -> dict[str, Any]:
    from tandem import LLM

    common = {
        "model": "default",
        "executor": "process",
        "worker_num_threads": threads,
        "max_num_seqs": num_requests,
        "num_kv_blocks": 512,
        "block_size": 16,
        "max_model_len": 1024,
    }
    llms = {mode: LLM(async_scheduling=mode == "async", **common) for mode in ("sync", "async")}
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for llm in llms.values():  # warm-up: compile the grammar, first steps
            mixed_batch_run(llm, 0.25, 8)
        for _ in range(repeats):
            for fraction in (0.0, 0.25):
                for mode, llm in llms.items():
                    key = f"{mode}-{int(fraction * 100)}pct"
                    runs.setdefault(key, []).append(mixed_batch_run(llm, fraction, num_requests))
    finally:
        for llm in llms.values():
            llm.shutdown()
    med = {
        key: {
            "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in rs),
            "unconstrained_tokens_per_s_per_request": statistics.median(
                r["unconstrained_tokens_per_s_per_request"] for r in rs
            ),
            "seconds": statistics.median(r["seconds"] for r in rs),
        }
        for key, rs in runs.items()
    }
    tps = {key: m["output_tokens_per_s"] for key, m in med.items()}
    return {
        "num_requests": num_requests,
        "max_tokens": 64,
        "medians": med,
        "async_over_sync_0pct": tps["async-0pct"] / tps["sync-0pct"],
        "async_over_sync_25pct": tps["async-25pct"] / tps["sync-25pct"],
        "constrained_over_free_sync": tps["sync-25pct"] / tps["sync-0pct"],
        "constrained_over_free_async": tps["async-25pct"] / tps["async-0pct"],
        "unconstrained_request_rate_25_over_0_sync": (
            med["sync-25pct"]["unconstrained_tokens_per_s_per_request"]
            / med["sync-0pct"]["unconstrained_tokens_per_s_per_request"]
        ),
        "unconstrained_request_rate_25_over_0_async": (
            med["async-25pct"]["unconstrained_tokens_per_s_per_request"]
            / med["async-0pct"]["unconstrained_tokens_per_s_per_request"]
        ),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="worker torch threads")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--skip-deferral", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "bitmask": [bitmask_benchmark(b, args.requests) for b in ("xgrammar", "outlines")],
    }
    if not args.skip_deferral:
        result["deferral"] = deferral_benchmark(args.repeats, args.threads, args.requests)
    result.update(
        engine_threads=1,
        worker_threads=args.threads,
        load_average=os.getloadavg(),
        cpu_count=os.cpu_count(),
    )
    (ROOT / "results" / "structured_output.json").write_text(json.dumps(result, indent=2))
    summary = {k: v for k, v in result.get("deferral", {}).items() if k != "runs"}
    print(json.dumps({"bitmask": result["bitmask"], "deferral": summary}, indent=2))


if __name__ == "__main__":
    main()
