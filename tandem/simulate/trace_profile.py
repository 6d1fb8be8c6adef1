"""Timing the real engine's steps under traffic (`tandem simulate calibrate --traffic`).

`replay_steps` sends a traffic list into an in-process `EngineCore` on the real clock, open
loop (each request is added once its arrival time has passed, between steps; the engine
idles until the next arrival when it has no work), and times every step with a
`StepTimer`, as the grid does. Requests are greedy, generate exactly their
`output_tokens` (EOS ignored) and carry `prompt_token_ids` ids drawn from `seed`.

Why a fit wants these steps besides the grid's: a grid repeats each shape on the same warm
requests and KV blocks, while under traffic the shapes change step to step and requests
and blocks are fresh; on a 2-core Xeon the same shape ran 3-7 % slower in a replayed trace
than in the grid, and a low-rate trace's steps are almost all decodes of 1-4 requests, a
handful of the grid's points. Fitting the traffic's steps, each counted once, prices the
shapes the traffic has as the engine runs them under traffic.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tandem.core.engine_core import EngineCore
from tandem.core.request import Request
from tandem.schema.sampling_params import SamplingParams
from tandem.simulate.step_profile import StepSample, StepTimer
from tandem.simulate.traffic import TrafficRequest, prompt_token_ids

#: Requests of the unrecorded warm-up before a replay (prompt tokens, output tokens).
WARM_UP: tuple[tuple[int, int], ...] = ((64, 8), (64, 8), (64, 8))


def traffic_request(
    engine: EngineCore, rid: str, entry: TrafficRequest, index: int, seed: int
) -> Request:
    """The engine request for traffic entry `index`: its prompt ids (`prompt_token_ids`),
    greedy, exactly `output_tokens` tokens (EOS ignored), its priority."""
    model = engine.config.model
    return Request(
        request_id=rid,
        prompt_token_ids=prompt_token_ids(entry, index, model.vocab_size or 2, seed),
        sampling_params=SamplingParams(
            temperature=0.0, max_tokens=entry.output_tokens, ignore_eos=True
        ),
        eos_token_id=model.eos_token_id,
        priority=entry.priority,
    )


def replay_steps(
    engine: EngineCore,
    traffic: list[TrafficRequest],
    seed: int,
    label: str = "traffic",
    log: Callable[[str], None] = print,
) -> list[StepSample]:
    """Every step with tokens of `traffic` replayed on `engine` (idle, synchronous
    scheduling) on the real clock, labelled `label`; the engine is idle afterwards and
    its executor unwrapped. A short unrecorded warm-up runs first."""
    timer = StepTimer(engine)
    samples: list[StepSample] = []
    try:
        for i, (prompt, output) in enumerate(WARM_UP):
            warm = TrafficRequest(0.0, prompt, output)
            engine.add_request(traffic_request(engine, f"{label}-warm-{i}", warm, i, seed + 1))
        while engine.has_work():
            timer.step("warm-up")
        sent, start = 0, time.monotonic()
        while sent < len(traffic) or engine.has_work():
            now = time.monotonic() - start
            while sent < len(traffic) and traffic[sent].arrival_s <= now:
                rid = f"{label}-{sent}"
                engine.add_request(traffic_request(engine, rid, traffic[sent], sent, seed))
                sent += 1
            if not engine.has_work():
                time.sleep(max(0.0, traffic[sent].arrival_s - (time.monotonic() - start)))
                continue
            sample = timer.step(label)
            if sample is not None:
                samples.append(sample)
    finally:
        timer.restore()
    log(f"{label}: {len(traffic)} requests, {len(samples)} steps replayed")
    return samples
