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
from pathlib import Path

import torch

from tandem.trace import record

ROOT = Path(__file__).resolve().parent


def run(async_scheduling: bool, requests: int, prompt: int, output: int) -> dict:
    _, stats = record(async_scheduling, requests, prompt, output, max_num_batched_tokens=8192)
    return stats


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
