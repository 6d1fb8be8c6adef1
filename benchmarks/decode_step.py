"""Time one decode step of 64 requests (contexts 250-350) on the embedded model and print
the top of a cProfile of three such steps: where a decode step's time goes.

    python benchmarks/decode_step.py [--threads 2]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch

from tandem import LLM, SamplingParams
from tandem.core.request import Request


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(
        async_scheduling=False,
        max_model_len=4096,
        worker_num_threads=args.threads,
        max_num_batched_tokens=8192,
    )
    torch.set_num_threads(args.threads)
    rng = random.Random(1)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i in range(args.requests):
        prompt = [rng.randint(100, 40_000) for _ in range(rng.randint(250, 350))]
        engine.add_request(Request(str(i), prompt, params, eos_token_id=2))
    while engine.scheduler_state.waiting:
        engine.step()
    engine.step()
    times = []
    profile = cProfile.Profile()
    for i in range(6):
        if i == 3:
            profile.enable()
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    profile.disable()
    print(
        f"decode step of {args.requests} requests: median {statistics.median(times) * 1000:.0f} ms "
        f"over {len(times)} steps ({args.threads} threads)"
    )
    pstats.Stats(profile).sort_stats("tottime").print_stats(10)


if __name__ == "__main__":
    main()
