"""A/B of the two model paths on the latency workload, in one process, interleaved:
tandem's fused decoder vs transformers' modules with tandem's paged attention plugged into
the attention registry. Writes benchmarks/results/model_path.json (medians of 3 runs each).

    python benchmarks/model_path.py [--threads 2] [--tokens 48]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from pathlib import Path
from unittest import mock

import torch

from tandem import LLM, SamplingParams
from tandem.models.hf_model import HFStepModel

ROOT = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kwargs = dict(async_scheduling=False, max_model_len=2048, worker_num_threads=args.threads)
    # The fused decoder releases the HF layers' weights, so each arm loads its own model.
    llms = {"fused_decoder": LLM(**kwargs)}
    unfused = functools.partialmethod(HFStepModel.__init__, fused=False)
    with mock.patch.object(HFStepModel, "__init__", unfused):
        llms["hf_modules_registry"] = LLM(**kwargs)
    prompt = json.loads((ROOT / "workloads" / "latency.json").read_text())["requests"][0][
        "prompt_token_ids"
    ]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    ms: dict[str, list[float]] = {"fused_decoder": [], "hf_modules_registry": []}
    for _ in range(args.repeats):
        for name in ms:
            out = llms[name].generate([prompt], params)[0]
            m = out.metrics
            ms[name].append(1000 * (m.finished_time - m.first_token_time) / (args.tokens - 1))
    result = {
        "ms_per_token_median": {k: statistics.median(v) for k, v in ms.items()},
        "runs": ms,
        "ratio_hf_over_fused": statistics.median(ms["hf_modules_registry"])
        / statistics.median(ms["fused_decoder"]),
        "threads": args.threads,
        "load_average": os.getloadavg(),
    }
    out_path = ROOT / "results" / "model_path.json"
    out_path.write_text(json.dumps(result, indent=2))
    print(
        json.dumps(result["ms_per_token_median"]), "ratio", round(result["ratio_hf_over_fused"], 3)
    )


if __name__ == "__main__":
    main()
