"""The engine's own CPU cost per step, this tree against another version, side by side.

On the scripted model (no weights: the forward is a few tensor ops), `LLM.generate` is
almost all engine and runner Python: scheduling, hooks, input preparation, sampling,
output processing. The figure is process CPU milliseconds per decode step (one step
decodes every request of the batch), for a batch of 1 and a batch of 64, sync and async,
one torch thread. Each version runs in its own process (`--child`); the "before" process
imports tandem from `--before` (a directory whose `tandem/` package is the old code), the
other the installed tree; runs alternate, medians over `--rounds`.

    python benchmarks/step_overhead.py --before /tmp/before_pkg --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MAX_TOKENS = 96
CASES = [(1, False), (1, True), (64, False), (64, True)]


def measure() -> dict[str, float]:
    """CPU ms per decode step for each (batch, async) case, in this process."""
    import torch

    from tandem import LLM, SamplingParams

    torch.set_num_threads(1)
    result = {}
    for batch, use_async in CASES:
        llm = LLM(
            model="scripted",
            async_scheduling=use_async,
            max_num_seqs=64,
            max_model_len=512,
        )
        prompts = [[5 + (i % 50), 7, 9, 11 + i % 7] * 8 for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm up
        start = time.process_time()
        llm.generate(prompts, params, use_tqdm=False)
        cpu = time.process_time() - start
        llm.shutdown()
        result[f"batch{batch}_{'async' if use_async else 'sync'}_cpu_ms_per_step"] = (
            cpu * 1000 / MAX_TOKENS
        )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--before", default="/tmp/before_pkg")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results/step_overhead.json"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return 0
    tmp = Path(tempfile.mkdtemp())
    script = tmp / "step_overhead.py"
    shutil.copy(__file__, script)  # run outside the checkout: the cwd must not shadow
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for version in ("before", "after") if i % 2 == 0 else ("after", "before"):
            env = dict(os.environ, OMP_NUM_THREADS="1")
            env.pop("PYTHONPATH", None)
            if version == "before":
                env["PYTHONPATH"] = args.before
            proc = subprocess.run(
                [sys.executable, str(script), "--child"],
                env=env,
                cwd=tmp,
                capture_output=True,
                text=True,
                check=True,
            )
            runs[version].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    keys = list(runs["after"][0])
    medians = {v: {k: statistics.median(r[k] for r in rs) for k in keys} for v, rs in runs.items()}
    out: dict[str, Any] = {
        "what": __doc__.splitlines()[0],
        "rounds": args.rounds,
        "medians": medians,
        "after_over_before": {k: medians["after"][k] / medians["before"][k] for k in keys},
        "load_average": os.getloadavg(),
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("medians", "after_over_before")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
