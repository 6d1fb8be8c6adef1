"""The measured side of `simulate_fidelity.py`: a traffic list replayed into the real engine.

Open loop, real wall-clock arrivals, through `AsyncLLM`: the engine core runs in its own
process and this process is the front end (request building, detokenisation), exactly as
`tandem serve` runs them minus HTTP. That is the shape whose latencies a simulation of a
serving stack should predict: the engine core's loop picks up arrivals only between steps,
and its CPU time (scheduling, output encoding) is spent in the serving process layout.

Each request is sent at `start + arrival_s` (an asyncio task sleeping until then; the
send's lateness is recorded) with the prompt ids `tandem.simulate.traffic.prompt_token_ids`
gives the simulation (same index and seed), greedy, exactly `output_tokens` tokens (EOS
ignored), streamed as deltas. Every delta's tokens are stamped with `time.monotonic()`
when the front end receives it; arrivals are the scheduled ones (an open-loop client's
view). Times are seconds from the replay's start, as the simulator's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tandem.engine.async_llm import AsyncLLM
from tandem.schema.sampling_params import RequestOutputKind, SamplingParams
from tandem.simulate.report import RequestTimeline
from tandem.simulate.traffic import TrafficRequest, prompt_token_ids

#: Seconds between scheduling the replay and its time 0 (the tasks' set-up).
LEAD_S = 0.2


@dataclass(slots=True)
class Replay:
    """One replay's timelines, its wall seconds, and the largest lateness of a send (s)."""

    timelines: list[RequestTimeline]
    wall_s: float
    max_send_lateness_s: float


async def _one(
    llm: AsyncLLM,
    start: float,
    index: int,
    entry: TrafficRequest,
    ids: list[int],
    timeline: RequestTimeline,
    lateness: list[float],
) -> None:
    await asyncio.sleep(max(0.0, start + entry.arrival_s - time.monotonic()))
    lateness.append(time.monotonic() - start - entry.arrival_s)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=entry.output_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    async for out in llm.generate({"prompt_token_ids": ids}, params, f"fid-{index}"):
        now = time.monotonic() - start
        timeline.token_times_s.extend([now] * sum(len(c.token_ids) for c in out.outputs))
        if out.finished:
            timeline.finish_s = now
            timeline.finish_reason = out.outputs[0].finish_reason if out.outputs else "error"


async def replay(llm: AsyncLLM, traffic: list[TrafficRequest], vocab: int, seed: int) -> Replay:
    """Send `traffic` open loop into `llm` and wait for every request to finish."""
    prompts = [prompt_token_ids(t, i, vocab, seed) for i, t in enumerate(traffic)]
    timelines = [
        RequestTimeline(f"fid-{i}", t.arrival_s, t.prompt_tokens) for i, t in enumerate(traffic)
    ]
    lateness: list[float] = []
    start = time.monotonic() + LEAD_S
    await asyncio.gather(
        *(_one(llm, start, i, t, prompts[i], timelines[i], lateness) for i, t in enumerate(traffic))
    )
    return Replay(timelines, time.monotonic() - start, max(lateness, default=0.0))


async def warm_up(llm: AsyncLLM, vocab: int) -> None:
    """Unmeasured: two short requests together (first-use compilation, allocator)."""
    warm = [TrafficRequest(0.0, 48, 8), TrafficRequest(0.0, 200, 8)]
    await replay(llm, warm, vocab, seed=12345)
