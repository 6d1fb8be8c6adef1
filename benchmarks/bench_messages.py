"""Encode + decode time of the worker pipe's messages: typed MessagePack vs pickle.

Batch-64 `SchedulerOutput`s: a decode step (64 running requests, one token each, a new
block for every 16th) and a prefill step (64 new requests of 256-token prompts with
non-default sampling parameters, one object shared by all or one each), and a step's reply (a
`ModelRunnerOutput` with one token per request, and with 5 top logprobs each). For each, the
median over `--repeats` rounds of the mean time per encode+decode of `--iters` round trips,
for `tandem.core.messages` (`encode` + a typed `decoder`) and for `pickle.dumps` +
`pickle.loads` of the same object (what the pipe carried before), and the sizes in bytes.

    python benchmarks/bench_messages.py   # writes benchmarks/results/messages.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from tandem.core.messages import ExecuteModel, FromWorker, ToWorker, WorkerReply, decoder, encode
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tandem.schema.sampling_params import SamplingParams

OUT = Path(__file__).resolve().parent / "results" / "messages.json"
BATCH = 64


def decode_step() -> SchedulerOutput:
    cached = [
        CachedRequestData(f"req-{i}", [1000 + i] if i % 16 == 0 else [], 300 + i)
        for i in range(BATCH)
    ]
    return SchedulerOutput(
        step_id=1234,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={c.req_id: 1 for c in cached},
        total_num_scheduled_tokens=BATCH,
    )


def prefill_step(shared_params: bool) -> SchedulerOutput:
    """New requests sharing one `SamplingParams` object (one `generate` call) or each with
    its own (separate clients); pickle writes a shared object once."""

    def params(i: int) -> SamplingParams:
        seed = 7 if shared_params else i
        return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=128, stop=["\n"])

    shared = params(0)
    new = [
        NewRequestData(
            f"req-{i}",
            list(range(i, i + 256)),
            256,
            shared if shared_params else params(i),
            list(range(16)),
            0,
            2,
        )
        for i in range(BATCH)
    ]
    return SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=new,
        num_scheduled_tokens={n.req_id: 256 for n in new},
        total_num_scheduled_tokens=256 * BATCH,
    )


def reply(top_logprobs: int) -> ModelRunnerOutput:
    ids = [f"req-{i}" for i in range(BATCH)]
    logprobs = None
    if top_logprobs:
        logprobs = [
            [{i + k: (-0.1 * k, k + 1) for k in range(top_logprobs + 1)}] for i in range(BATCH)
        ]
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[i] for i in range(BATCH)],
        logprobs=logprobs,
    )


def per_call_us(fn: Any, iters: int, repeats: int) -> float:
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(rounds)


def measure(message: Any, channel: Any, payload: Any, iters: int, repeats: int) -> dict:
    typed = decoder(channel)
    assert typed.decode(encode(message)) == message
    assert pickle.loads(pickle.dumps(payload)) == payload
    msg_us = per_call_us(lambda: typed.decode(encode(message)), iters, repeats)
    pickle_us = per_call_us(lambda: pickle.loads(pickle.dumps(payload)), iters, repeats)
    return {
        "messages_us": round(msg_us, 2),
        "pickle_us": round(pickle_us, 2),
        "messages_over_pickle": round(msg_us / pickle_us, 3),
        "messages_bytes": len(encode(message)),
        "pickle_bytes": len(pickle.dumps(payload)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    cases = {
        "decode_step_scheduler_output": (ExecuteModel(decode_step()), ToWorker),
        "prefill_step_shared_params": (ExecuteModel(prefill_step(True)), ToWorker),
        "prefill_step_params_per_request": (ExecuteModel(prefill_step(False)), ToWorker),
        "reply_one_token_each": (WorkerReply(reply(0)), FromWorker),
        "reply_with_5_top_logprobs": (WorkerReply(reply(5)), FromWorker),
    }
    results: dict[str, Any] = {}
    for name, (message, channel) in cases.items():
        payload = message.scheduler_output if isinstance(message, ExecuteModel) else message.output
        results[name] = measure(message, channel, payload, args.iters, args.repeats)
    results["setup"] = {
        "batch": BATCH,
        "iters": args.iters,
        "repeats": args.repeats,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
        "command": "python benchmarks/bench_messages.py",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
