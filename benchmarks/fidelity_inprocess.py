"""The calibrated simulation against the real engine in this process, same trace, sync.

    python benchmarks/fidelity_inprocess.py --fit FIT.json [--rates 1.7,2.7] [--requests 96]

`simulate_fidelity.py`'s trace (Poisson arrivals, prompts uniform(16,128), outputs
uniform(16,64), seed 0; fresh prompt ids per rate) replayed open loop into an in-process
`EngineCore` of the embedded model (one worker thread, requests added between steps, every
output token stamped when its step returns), then simulated with the fit on the inline
device (`overlap=False`, the fit's engine time). Prints TTFT / TPOT p50 and p90 and output
throughput for both, simulated / real, and the step counts by kind (decode batch size,
prefill, mixed). No front end or IPC on the measured side, so the figures isolate the cost model
and the scheduling from `AsyncLLM`'s process layout (`simulate_fidelity.py` measures that).
The simulated step counts by kind are printed so a miss can be traced to batching.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simulate_fidelity import prompt_seed, real_config, sim_config, summary_of, traffic_at  # noqa: E402

from tandem.core.engine_core import EngineCore  # noqa: E402
from tandem.plugins.cost_models.calibrated import load_fit  # noqa: E402
from tandem.simulate.driver import simulate  # noqa: E402
from tandem.simulate.report import RequestTimeline  # noqa: E402
from tandem.simulate.trace_profile import traffic_request  # noqa: E402
from tandem.simulate.traffic import TrafficRequest  # noqa: E402


def replay(engine: EngineCore, traffic: list[TrafficRequest], seed: int) -> list[RequestTimeline]:
    """Timelines of `traffic` replayed in-process on the real clock."""
    timelines = {
        f"r{i}": RequestTimeline(f"r{i}", t.arrival_s, t.prompt_tokens)
        for i, t in enumerate(traffic)
    }
    sent, start = 0, time.monotonic()
    while sent < len(traffic) or engine.has_work():
        now = time.monotonic() - start
        while sent < len(traffic) and traffic[sent].arrival_s <= now:
            engine.add_request(traffic_request(engine, f"r{sent}", traffic[sent], sent, seed))
            sent += 1
        if not engine.has_work():
            time.sleep(max(0.0, traffic[sent].arrival_s - (time.monotonic() - start)))
            continue
        outputs, _ = engine.step()
        now = time.monotonic() - start
        for out in outputs:
            timeline = timelines[out.request_id]
            timeline.token_times_s.extend([now] * len(out.new_token_ids))
            if out.finished:
                timeline.finish_s, timeline.finish_reason = now, out.finish_reason
    return list(timelines.values())


def brief(summary: dict[str, Any]) -> dict[str, float]:
    return {
        "ttft_p50": summary["ttft_ms"]["p50"],
        "ttft_p90": summary["ttft_ms"]["p90"],
        "tpot_p50": summary["tpot_ms"]["p50"],
        "tpot_p90": summary["tpot_ms"]["p90"],
        "output_throughput": summary["output_throughput"],
    }


def kind(tokens: list[int]) -> str:
    if all(t == 1 for t in tokens):
        return f"decode {min(len(tokens), 9)}{'+' if len(tokens) >= 9 else ''}"
    return "mixed" if 1 in tokens else "prefill"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", type=Path, required=True)
    p.add_argument("--rates", default="1.7,2.7")
    p.add_argument("--requests", type=int, default=96)
    args = p.parse_args()
    trace = argparse.Namespace(requests=args.requests, prompt="16,128", output="16,64", seed=0)
    config = real_config(False, 1)
    fit = load_fit(args.fit)
    rates = [float(r) for r in args.rates.split(",")]
    engine = EngineCore(config, source="fidelity_inprocess")
    try:
        replay(engine, [TrafficRequest(0.0, 48, 8), TrafficRequest(0.0, 200, 8)], 12345)  # warm-up
        for rate in rates:
            traffic = traffic_at(trace, rate, config.max_model_len)
            seed = prompt_seed(trace, rate, rates)
            timelines = replay(engine, traffic, seed)
            real = brief(summary_of(timelines))
            sim = simulate(
                sim_config(config, args.fit),
                traffic,
                engine_time=fit.engine_time(),
                seed=seed,
                overlap=False,
                keep_steps=True,
            )
            predicted = brief(summary_of(sim.timelines))
            print(f"rate {rate}: real      { ({k: round(v, 1) for k, v in real.items()}) }")
            print(f"           simulated { ({k: round(v, 1) for k, v in predicted.items()}) }")
            print(
                f"           simulated / real { ({k: round(predicted[k] / real[k], 3) for k in real}) }"
            )
            kinds = Counter(kind(list(s.num_scheduled_tokens.values())) for s in sim.steps or [])
            print(f"           simulated steps {sum(kinds.values())}: {sorted(kinds.items())}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
