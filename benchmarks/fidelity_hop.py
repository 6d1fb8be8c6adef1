"""The serving front end's hop: what `AsyncLLM` adds to a lone request's time to first token.

The simulator stamps a token when its step ends on the virtual clock. Through `AsyncLLM`
(`fidelity_replay`: the engine core in its own process, this process the front end) the
client sees it later: the engine core encodes its outputs and its output thread sends them,
this process's reader thread decodes them and hands them to the event loop, which builds
the request's output. `measure_front_end_hop` measures that as the difference between the
time to first token of a lone request (1 output token, nothing else running) through
`AsyncLLM` and through the in-process `LLM` (which runs the same step in this process and
returns at once), alternating the two per prompt so a drift of the machine's speed falls on
both. The median difference over every prompt is `EngineTime.output_s`.

    python benchmarks/fidelity_hop.py [--threads 1] [--prompts 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

#: Prompt lengths (tokens) of the measured requests: short and long prefills.
PROMPT_TOKENS = (16, 64, 128)


async def _first_token_s(llm: Any, prompt: list[int], request_id: str) -> float:
    from tandem.schema.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    async for _ in llm.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
        return time.perf_counter() - start
    raise RuntimeError(f"{request_id}: no output")


def measure_front_end_hop(threads: int, prompts: int = 8, seed: int = 0) -> dict[str, Any]:
    """`{"output_s": median hop, "per_length": {tokens: [hop, ...]}}` over `prompts`
    fresh prompts of each length in `PROMPT_TOKENS` (ids drawn from `seed`: no prefix-cache
    hits), after one unmeasured request through each engine."""
    from tandem import LLM
    from tandem.engine.async_llm import AsyncLLM
    from tandem.schema.sampling_params import SamplingParams

    inprocess = LLM(model="default", worker_num_threads=threads)
    served = AsyncLLM(model="default", worker_num_threads=threads)
    vocab = served.config.model.vocab_size or 32000
    generator = random.Random(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def fresh(n: int) -> list[int]:
        return [generator.randrange(100, vocab) for _ in range(n)]

    async def run() -> dict[int, list[float]]:
        hops: dict[int, list[float]] = {n: [] for n in PROMPT_TOKENS}
        inprocess.generate([fresh(32)], params, use_tqdm=False)
        await _first_token_s(served, fresh(32), "warm-up")
        for i in range(prompts):
            for n in PROMPT_TOKENS:
                start = time.perf_counter()
                inprocess.generate([fresh(n)], params, use_tqdm=False)
                local = time.perf_counter() - start
                remote = await _first_token_s(served, fresh(n), f"hop-{n}-{i}")
                hops[n].append(remote - local)
                await asyncio.sleep(0.05)
        return hops

    try:
        hops = asyncio.run(run())
    finally:
        served.shutdown()
        inprocess.engine.shutdown()
    every = [h for values in hops.values() for h in values]
    return {"output_s": max(0.0, statistics.median(every)), "per_length": hops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    args = parser.parse_args()
    result = measure_front_end_hop(args.threads, args.prompts)
    summary = {n: round(1000 * statistics.median(v), 2) for n, v in result["per_length"].items()}
    print(json.dumps({"output_ms": 1000 * result["output_s"], "median_ms_by_length": summary}))


if __name__ == "__main__":
    main()
