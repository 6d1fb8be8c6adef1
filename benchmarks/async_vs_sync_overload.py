"""Sync against async scheduling past saturation, through `AsyncLLM`, rounds interleaved.

    python benchmarks/async_vs_sync_overload.py [--rate 5.731] [--rounds 2] [--requests 96]

`simulate_fidelity.py`'s trace (Poisson arrivals at `--rate`, prompts uniform(16,128),
outputs uniform(16,64), seed 0) replayed open loop into the embedded model, one worker
thread, alternating sync and async rounds, each round a fresh `AsyncLLM` (its own
engine-core process, warmed up) with fresh prompt ids. Prints request throughput, TTFT p50
and TPOT p50 per round. Why: `simulate_fidelity.py` measures its modes one after the other,
so a machine that slows during the run reads as one mode being slower; alternating rounds
in fresh processes separates the mode from the drift and from one process's luck.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_replay import replay, warm_up  # noqa: E402
from simulate_fidelity import summary_of, traffic_at  # noqa: E402

from tandem.engine.async_llm import AsyncLLM  # noqa: E402


async def one_round(llm: AsyncLLM, rate: float, requests: int, seed: int) -> dict[str, Any]:
    trace = argparse.Namespace(requests=requests, prompt="16,128", output="16,64", seed=0)
    vocab = llm.config.model.vocab_size or 0
    await warm_up(llm, vocab)
    run = await replay(llm, traffic_at(trace, rate, llm.config.max_model_len), vocab, seed)
    return summary_of(run.timelines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=5.731)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=96)
    args = p.parse_args()
    for k in range(args.rounds):
        for mode in ("sync", "async"):
            llm = AsyncLLM(model="default", async_scheduling=mode == "async", worker_num_threads=1)
            try:
                s = asyncio.run(one_round(llm, args.rate, args.requests, 777 + k))
            finally:
                llm.shutdown()
            print(
                f"round {k} {mode:5s} throughput {s['request_throughput']:.3f} req/s  "
                f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms  TPOT p50 {s['tpot_ms']['p50']:.1f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
