"""Does async scheduling hide the engine's CPU time? Sync vs async on the simulated device.

256 requests (512-token prompts, 256 output tokens) on the scripted model (vocab 128, so
its own compute stays far below the modelled step time) with the
simulated-device cost model of `SimulatedDeviceConfig` (16.06 GB bf16 weights, 131,072 KV
bytes per token, 3.84 TB/s, 594 TFLOP/s, 2 x 8.03 GFLOP per token). Reports, from the
device spans recorded during the run: the device-busy fraction of wall time, the engine's
CPU ms per step (thread CPU time of the engine loop) and the modelled device ms per step.
Writes benchmarks/results/simulated_overlap.json.

    python benchmarks/simulated_overlap.py [--requests 256] [--prompt 512] [--output 256]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams
from tandem.testing import make_scripted_engine

ROOT = Path(__file__).resolve().parent


def run(async_scheduling: bool, requests: int, prompt: int, output: int) -> dict:
    max_len = prompt + output + 16
    engine = make_scripted_engine(
        parallel={"executor": "simulated"},
        async_scheduling=async_scheduling,
        check_invariants=False,
        max_model_len=max_len,
        max_num_seqs=requests,
        max_num_batched_tokens=8192,
        block_size=16,
        num_kv_blocks=requests * (-(-max_len // 16)),
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    for i in range(requests):
        tokens = [rng.randrange(2, 128) for _ in range(prompt)]
        engine.add_request(Request(str(i), tokens, params, eos_token_id=1))
    steps = 0
    cpu = 0.0
    start = time.perf_counter()
    while engine.has_work():
        t0 = time.thread_time()
        engine.step_fn()
        cpu += time.thread_time() - t0
        steps += 1
    end = time.perf_counter()
    executor = engine.executor
    device_steps = [s for s in executor.spans if s.kind == "execute"]
    device_s = sum(s.end - s.start for s in device_steps)
    engine.shutdown()
    return {
        "async_scheduling": async_scheduling,
        "wall_s": end - start,
        "device_busy_fraction": executor.busy_fraction(start, end),
        "engine_cpu_ms_per_step": 1000 * cpu / max(steps, 1),
        "modelled_device_ms_per_step": 1000 * device_s / max(len(device_steps), 1),
        "engine_calls": steps,
        "device_steps": len(device_steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [run(mode, args.requests, args.prompt, args.output) for mode in (False, True)]
    out = {
        "workload": vars(args),
        "sync": results[0],
        "async": results[1],
        "async_speedup": results[0]["wall_s"] / results[1]["wall_s"],
        "load_average": os.getloadavg(),
    }
    (ROOT / "results" / "simulated_overlap.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
