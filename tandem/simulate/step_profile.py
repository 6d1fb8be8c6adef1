"""Timing the real engine's steps over a grid of batch shapes (`tandem simulate calibrate`).

`StepTimer` wraps one `EngineCore`'s executor: each `engine.step()` is timed with
`time.perf_counter()` as a whole (wall) and, inside it, from the executor's
`execute_model` / `sample_tokens` call to its future's result (device: the forward pass,
logits and sampling); the rest of the step is the engine's own CPU time (scheduling,
bookkeeping, output processing). The step's shape comes from the `SchedulerOutput` the
executor was handed (`step_shape_of`, as the simulated device computes it). Use it with
synchronous scheduling: the wrapper waits for each future at once.

`GridProfiler` drives the engine through the grid, cheapest points first, until its
deadline: single-request prefills of several chunk lengths; decode batches of
decreasing size B at several contexts (B requests prefilled together, which also gives
multi-request prefill steps, then aborted down to each smaller B); mixed steps (a decode
batch plus one prompt). Prompts are random token ids (no prefix-cache hits), greedy, EOS
ignored. Each grid point is repeated (`repeats` steps, one for prefills longer than
`LONG_PREFILL`; the first step after a batch change is not recorded). A decode's context
grows by one token per step over its phase (a few dozen tokens): points are labelled by
the context they started from.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tandem.core.engine_core import EngineCore
from tandem.core.request import Request
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.step_shape import StepShape, step_shape_of
from tandem.schema.sampling_params import SamplingParams

#: Default grid: single-request prefill chunk lengths (tokens).
PREFILL_LENGTHS: tuple[int, ...] = (16, 32, 64, 128, 256, 1024, 2048)
#: Default grid: decode batch sizes (requests).
DECODE_BATCHES: tuple[int, ...] = (64, 32, 16, 8, 4, 2, 1)
#: Default grid: decode contexts (tokens) with the largest batch tried at each (the cost of
#: prefilling B x context tokens first bounds it).
DECODE_PHASES: tuple[tuple[int, int], ...] = ((64, 64), (256, 16), (1024, 8), (256, 64))
#: Batch sizes at which a mixed step (the decodes plus one prompt of MIX_PROMPT) is timed.
MIX_BATCHES: tuple[int, ...] = (16, 4)
MIX_PROMPT = 256
#: Prefills longer than this (tokens) are timed once, not `repeats` times.
LONG_PREFILL = 512


class OutOfTime(Exception):
    """The profile's deadline passed."""


@dataclass(frozen=True, slots=True)
class StepSample:
    """One timed step with tokens: its grid point, shape, and seconds (wall of
    `engine.step()`; device = execute + sample until their futures resolved)."""

    label: str
    shape: StepShape
    wall_s: float
    device_s: float

    @property
    def engine_s(self) -> float:
        """The engine's own CPU seconds: wall minus device (>= 0)."""
        return max(self.wall_s - self.device_s, 0.0)


class StepTimer:
    """Times `engine.step()` and its executor calls (module docstring). `restore()` puts
    the executor's methods back."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        executor = engine.executor
        self._calls = (executor.execute_model, executor.sample_tokens)
        timed_execute = self._timed(self._calls[0], capture=True)
        timed_sample = self._timed(self._calls[1], capture=False)
        executor.execute_model = timed_execute  # type: ignore[method-assign]
        executor.sample_tokens = timed_sample  # type: ignore[method-assign]
        parallel = engine.config.parallel
        self._layout = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self._device_s = 0.0
        self._output: SchedulerOutput | None = None

    def _timed(self, call: Callable[[Any], Any], capture: bool) -> Callable[[Any], Any]:
        def timed(arg: Any) -> Any:
            start = time.perf_counter()
            future = call(arg)
            future.result()
            self._device_s += time.perf_counter() - start
            if capture:
                self._output = arg
            return future

        return timed

    def restore(self) -> None:
        executor = self.engine.executor
        executor.execute_model, executor.sample_tokens = self._calls  # type: ignore[method-assign]

    def step(self, label: str) -> StepSample | None:
        """Run one engine step; its sample, or None when it scheduled no tokens."""
        self._device_s, self._output = 0.0, None
        start = time.perf_counter()
        self.engine.step()
        wall = time.perf_counter() - start
        output = self._output
        if output is None or output.total_num_scheduled_tokens == 0:
            return None
        return StepSample(label, step_shape_of(output, *self._layout), wall, self._device_s)


@dataclass
class GridProfiler:
    """Runs the grid on `engine` until `deadline` (a `time.monotonic()` value); `samples`
    collects every recorded step, `log` receives one line per finished grid point."""

    engine: EngineCore
    deadline: float
    repeats: int = 3
    seed: int = 0
    log: Callable[[str], None] = print
    samples: list[StepSample] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.timer = StepTimer(self.engine)
        self.rng = random.Random(f"tandem.simulate.calibrate:{self.seed}")
        self._serial = 0
        self.live: set[str] = set()
        config = self.engine.config
        self.max_model_len = config.max_model_len
        self.max_batched = config.scheduler.max_num_batched_tokens
        self.max_seqs = config.scheduler.max_num_seqs
        self.kv_tokens = (config.cache.num_kv_blocks or 0) * config.cache.block_size
        vocab = config.model.vocab_size or 2
        self.id_range = (min(100, vocab // 2), min(vocab, 40_000))

    # Requests ---------------------------------------------------------------------------
    def add(self, prompt_len: int, max_tokens: int) -> str:
        """Add a request of `prompt_len` random ids generating exactly `max_tokens`."""
        self._serial += 1
        rid = f"cal-{self._serial}"
        low, high = self.id_range
        self.engine.add_request(
            Request(
                request_id=rid,
                prompt_token_ids=[self.rng.randrange(low, high) for _ in range(prompt_len)],
                sampling_params=SamplingParams(
                    temperature=0.0, max_tokens=max_tokens, ignore_eos=True
                ),
                eos_token_id=self.engine.config.model.eos_token_id,
            )
        )
        self.live.add(rid)
        return rid

    def step(self, label: str | None) -> StepSample | None:
        """One step (recorded under `label` unless None); OutOfTime past the deadline."""
        if time.monotonic() > self.deadline:
            raise OutOfTime
        sample = self.timer.step(label or "")
        if sample is not None and label is not None:
            self.samples.append(sample)
        return sample

    def drain(self) -> None:
        """Abort every live request and step until the engine is idle (not recorded)."""
        self.engine.abort_requests(sorted(self.live))
        self.live.clear()
        while self.engine.has_work():
            self.timer.step("")

    def seconds_per_prefill_token(self) -> float:
        """Median device seconds per token of the prefill points so far (0.0 if none)."""
        rates = [s.device_s / s.shape.num_tokens for s in self.samples if s.label[:8] == "prefill:"]
        return statistics.median(rates) if rates else 0.0

    # Grid points ------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Unrecorded: a few prompts and decodes (first-use compilation, allocator)."""
        for length in (32, min(256, self.max_model_len // 4)):
            self.add(length, 4)
        while self.engine.has_work():
            self.step(None)
        self.live.clear()

    def prefill(self, length: int) -> None:
        """Single-request prefills of `length` tokens (one chunk if it fits the token
        budget, else every chunk recorded under its own label): `repeats` of them up to
        `LONG_PREFILL` tokens, one above (a long step averages its own noise)."""
        for _ in range(self.repeats if length <= LONG_PREFILL else 1):
            self.add(length, 1)
            chunk = 0
            while self.engine.has_work():
                label = f"prefill:{length}" if chunk == 0 else f"chunk{chunk}:{length}"
                chunk += self.step(label) is not None
            self.live.clear()
        self.log(f"prefill {length:5d} tokens: {self._last_ms(f'prefill:{length}')}")

    def decode_phase(self, context: int, batch_max: int) -> None:
        """Decode batches of `DECODE_BATCHES` up to `batch_max` at `context`, with mixed
        steps at `MIX_BATCHES`; skipped (or its top batches dropped) when prefilling
        would not fit the time left, the KV pool, max_num_seqs or max_model_len."""
        batches = [b for b in DECODE_BATCHES if b <= min(batch_max, self.max_seqs)]
        steps = len(batches) * (self.repeats + 1) + len(MIX_BATCHES) * self.repeats + 4
        steps += -(-batches[0] * context // self.max_batched) if batches else 0  # the fill
        context = min(context, self.max_model_len - steps - 1)
        per_token = self.seconds_per_prefill_token()
        while batches and (
            batches[0] * (context + steps) > 0.9 * self.kv_tokens
            or 2 * batches[0] * context * per_token > self.deadline - time.monotonic()
        ):
            batches.pop(0)
        if context < 8 or not batches:
            self.skipped.append(f"decode context {context}, batch <= {batch_max}")
            return
        ids = [self.add(context, steps) for _ in range(batches[0])]
        while True:
            sample = self.step(f"fill:{context}x{batches[0]}")
            if sample is not None and sample.shape.num_prefill_tokens == 0:
                break
        for batch in batches:
            self._run_batch(ids, batch, context)
        self.drain()

    def _run_batch(self, ids: list[str], batch: int, context: int) -> None:
        dropped = ids[batch:]
        if any(rid in self.live for rid in dropped):
            self.engine.abort_requests(dropped)
            self.live.difference_update(dropped)
            self.step(None)  # the first step after a batch change is not recorded
        label = f"decode:{batch}:{context}"
        for _ in range(self.repeats):
            self.step(label)
        self.log(f"decode batch {batch:3d} context {context:5d}: {self._last_ms(label)}")
        if batch in MIX_BATCHES:
            prompt = min(MIX_PROMPT, self.max_batched - batch, self.max_model_len - 2)
            mixed = f"mixed:{batch}:{context}:{prompt}"
            for _ in range(self.repeats):
                rid = self.add(prompt, 1)
                self.step(mixed)
                self.live.discard(rid)
            self.log(f"mixed {batch:3d} decodes + {prompt} prompt: {self._last_ms(mixed)}")

    def _last_ms(self, label: str) -> str:
        walls = [s.wall_s for s in self.samples if s.label == label]
        devices = [s.device_s for s in self.samples if s.label == label]
        if not walls:
            return "-"
        wall, device = statistics.median(walls), statistics.median(devices)
        return f"{1000 * wall:8.1f} ms/step ({1000 * device:.1f} device)"

    def grid(self) -> Iterator[Callable[[], None]]:
        """The grid points as calls, cheap and common shapes first: short prefills, decode
        batches at the shortest context, then alternating longer contexts and longer
        prefills (each prefill point costs about as much as its tokens; a decode phase
        as its B x context prefill tokens)."""
        lengths = sorted(
            {min(n, self.max_batched, self.max_model_len - 1) for n in PREFILL_LENGTHS}
        )
        short, long = [n for n in lengths if n <= 256], [n for n in lengths if n > 256]
        for length in short:
            yield lambda n=length: self.prefill(n)
        phases = list(DECODE_PHASES)
        while phases or long:
            if phases:
                context, batch_max = phases.pop(0)
                yield lambda c=context, b=batch_max: self.decode_phase(c, b)
            if long:
                length = long.pop(0)
                yield lambda n=length: self.prefill(n)
        chunked = min(self.max_model_len - 1, self.max_batched + self.max_batched // 2)
        if chunked > self.max_batched:
            yield lambda: self.prefill(chunked)

    def run(self) -> list[StepSample]:
        """Warm up, then run the grid until it ends or the deadline passes; returns the
        samples. The engine is idle afterwards and its executor unwrapped."""
        try:
            self.warm_up()
            for point in self.grid():
                point()
        except OutOfTime:
            self.log("profile: out of time, the grid stops here")
        finally:
            self.timer.restore()
        self.drain()
        return self.samples
