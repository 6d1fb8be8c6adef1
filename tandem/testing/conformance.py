"""Plugin conformance suite: does a scheduler plugin behave like the reference scheduler?

A scheduler plugin may change *when* tokens are computed, never *which* tokens come out,
and it must keep the request ledger, the KV cache and the scheduling rules of the hook
contract (`tandem.core.hookspecs`). This module runs fixed, seeded workloads on the
scripted model with the plugin in the scheduler role and checks all of that, under
synchronous (`async_scheduling: false`, `EngineCore.step`) and asynchronous
(`async_scheduling: true`, `EngineCore.step_with_batch_queue`) scheduling.

Use from Python::

    from tandem.testing.conformance import run_conformance

    report = run_conformance("my-scheduler", {"some_option": 1})
    print(report.summary())
    report.raise_for_failures()        # ConformanceError naming the first failure

or from pytest, in any directory (even an empty one), one item per (check, mode)::

    python -m pytest -p tandem --tandem-conformance my-scheduler \\
        [--tandem-conformance-options '{"some_option": 1}']

The plugin is found by name through the entry-point group `tandem.plugins`, exactly as a
stack file names it: each engine runs the stack `[{"name": NAME, "options": OPTIONS},
{"name": "default-sampler"}]` (plus `async-scheduler`, which the plugin manager inserts
right after the scheduler when async scheduling is on), on the in-process executor.
Tests may also pass a plugin *class*; `registered_plugins` then makes it discoverable
under a temporary entry point for the duration of the run.

Checks (`CHECKS`), each run in both modes (`MODES`):

- `greedy-parity` (a): greedy outputs equal `expected_scripted_output`, and seeded
  (temperature 0.8) outputs equal the reference scheduler's run of the same workload.
- `ledger-invariants` (b): stress workloads (tiny token budgets, chunked prefill, KV pools
  of one sequence, prefix sharing) whose point is the per-step checks below.
- `kv-no-leak` (c): two waves of requests separated by an idle gap; every KV block is free
  whenever the engine is idle, and no block is ever held by a finished request.
- `all-finish` (d): edge cases (the `max_model_len` cap, `max_tokens=1`, one-token prompts,
  `min_tokens`, stop on the first token, identical prompts) all finish with the right
  reason within the step cap `Workload.step_cap()`.
- `bounded-wait` (e): under steady arrivals no request waits longer than `wait_bound`
  steps to be first scheduled (see "The waiting bound" below).
- `abort` (f): aborts of WAITING, prefilling, decoding and preempted requests, queued
  between steps and while a step is in flight (under async: while two are), and of a
  request that already finished: aborted requests end with finish reason "abort" and a
  strict prefix of their exact tokens, all others are exact, nothing leaks.
- `preemption` (f): KV pools the size of one max-length sequence force preemption by
  recompute; outputs stay exact and nothing leaks.
- `grammar-ready` (g): requests whose `grammar_ready()` stays False for a number of steps
  (a grammar compiling) are never scheduled before it turns True, the requests added
  behind them are scheduled meanwhile (waiting for a grammar blocks no one), and every
  request still finishes with exact outputs.

Per step, every check verifies (a violation raises `ConformanceError` naming the rule):

- the ledger and KV invariants (`tandem.plugins.invariant_checker.check_invariants`; the
  engines run with `check_invariants: true`, so its plugin also checks after every
  `update_from_output` and raises `InvariantViolation`, which is reported here with the
  invariant, the step, the request and its ledger);
- placeholder accounting: no output placeholders under sync scheduling; under async,
  `num_output_placeholders <= num_in_flight_tokens` (a placeholder stands for a sampled
  token whose step is still in flight, so resolving a step's result must remove them);
- KV blocks are held only by live (unfinished, registered) requests;
- the `schedule` contract: only live requests are scheduled, each with `0 <
  num_scheduled_tokens <= num_tokens_with_spec + num_output_placeholders -
  num_computed_tokens`; totals add up and respect `max_num_batched_tokens`; at most
  `max_num_seqs` requests RUNNING; new and cached request data name exactly the scheduled
  requests; no WAITING request is admitted in a step that preempted; `schedule` does not
  advance `num_computed_tokens` of running requests;
- the `update_after_schedule` contract: `num_computed_tokens` and `num_in_flight_tokens`
  grow by exactly `num_scheduled_tokens`;
- outputs: only for requests in the engine, nothing after a request finished.

At the end of every run: the engine is idle, the scheduler holds no requests, every KV
block is free, every request finished, and outputs are exact.

The waiting bound (check `bounded-wait`)
----------------------------------------
Let S = `max_num_seqs`, B = `max_num_batched_tokens`, P = the longest prompt and M = the
largest `max_tokens` of the workload, a = 1 under async scheduling (a finished request
holds its slot one more step, until its last result is processed) else 0. When request r
is added, let N be the number of unfinished requests added before it (running or
waiting: the queue ahead of it). Then r must be scheduled within

    wait_bound(N) = ceil(N * P / (B - S + 1)) + floor(N * (M + a) / S)

steps (the steps in which r is not scheduled, counted from the first step after it was
added). Soundness for an FCFS scheduler that follows the reference's rules (RUNNING first
in admission order, then WAITING in order, admission stops at the first request that does
not fit), in the workload's regime: FCFS policy, B >= S + 1, a KV pool of at least
3 * S * ceil((P + M) / block_size) blocks (no allocation ever fails, fenced frees
included), no prefill threshold, P + M < max_model_len, no drafts, no aborts. Before r is
admitted only the N requests ahead of it run (later arrivals queue behind r). Classify
each step in which r waits:

1. the token budget is exhausted. Then prefill tokens were scheduled (decodes alone are
   at most S < B tokens) and at most S - 1 decodes, so at least B - S + 1 prefill tokens
   of the N requests ahead; they have at most N * P prefill tokens in all, hence at most
   ceil(N * P / (B - S + 1)) such steps;
2. budget left over: every running request got all of its work, and r was not admitted
   although admission only stops on the budget, on S running requests or on KV; KV never
   fails and the budget is not exhausted, so S requests run. Each of them uses one of at
   most M + a such steps it can run in (the one completing its prefill, at most M - 1
   decodes, under async one more step before its last result is processed). The N
   requests ahead have at most N * (M + a) of these, S per step: at most
   floor(N * (M + a) / S) such steps.

A scheduler that starves a request (LIFO admission, always skipping the oldest request
while others arrive) exceeds the bound on the workload; the reference scheduler stays
within it (the report's details give the largest wait/bound ratio).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import math
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from tandem.core import hookimpl
from tandem.core.engine_core import EngineCore
from tandem.core.outputs import EngineCoreOutput
from tandem.core.plugin_manager import discover_plugins
from tandem.core.request import Request
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.scheduler_state import SchedulerState
from tandem.core.worker.scripted_model import scripted_next_token
from tandem.plugins.invariant_checker import InvariantViolation, check_invariants
from tandem.testing.engine import expected_scripted_output, make_request, scripted_config

Mode = Literal["sync", "async"]
#: Both scheduling modes, in the order the suite runs them.
MODES: tuple[Mode, ...] = ("sync", "async")
#: The plugin every scheduler is compared against.
REFERENCE_SCHEDULER = "reference-scheduler"
#: The scripted model's vocabulary and EOS in every workload.
VOCAB = 128
EOS = 1
#: Temperature of the seeded requests in `greedy-parity`.
SEEDED_TEMPERATURE = 0.8

Outputs = dict[str, tuple[list[int], str | None]]


# Errors and reports ---------------------------------------------------------------------


class ConformanceError(AssertionError):
    """A plugin broke a conformance rule.

    The message names the plugin, the check, the mode (sync/async), the workload, the step
    (the number of `EngineCore.step_fn` calls started; 0 = before the first step), the
    rule (`invariant`), the request and that request's ledger (`Request.ledger()`).
    """

    def __init__(
        self,
        *,
        plugin: str,
        check: str,
        mode: str,
        workload: str,
        step: int,
        invariant: str,
        detail: str,
        request_id: str | None = None,
        ledger: Mapping[str, object] | None = None,
    ) -> None:
        self.plugin = plugin
        self.check = check
        self.mode = mode
        self.workload = workload
        self.step = step
        self.invariant = invariant
        self.detail = detail
        self.request_id = request_id
        self.ledger = dict(ledger) if ledger is not None else None
        where = f"at step {step}" if step > 0 else "before the first step"
        lines = [
            f"tandem conformance: plugin {plugin!r} failed check {check!r} [{mode}] "
            f"(workload {workload!r}) {where}",
            f"  invariant: {invariant}",
            f"  detail: {detail}",
        ]
        if request_id is not None:
            lines.append(f"  request: {request_id}")
            lines.append(f"  ledger: {self.ledger if self.ledger is not None else 'unknown'}")
        super().__init__("\n".join(lines))


@dataclass
class CheckResult:
    """One (check, mode) of a conformance run: passed or the error, and run details
    (steps, preemptions, aborts, the largest wait/bound ratio, ...)."""

    check: str
    mode: str
    error: ConformanceError | None
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.error is None


@dataclass
class ConformanceReport:
    """What `run_conformance` found: one `CheckResult` per (check, mode), in run order."""

    plugin: str
    results: list[CheckResult]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def result(self, check: str, mode: str) -> CheckResult:
        """The result of `check` in `mode` (KeyError if it was not run)."""
        for r in self.results:
            if r.check == check and r.mode == mode:
                return r
        raise KeyError((check, mode))

    def raise_for_failures(self) -> None:
        """Raise the first failure's `ConformanceError` (the others are listed in it)."""
        failures = self.failures
        if not failures:
            return
        first = failures[0].error
        assert first is not None
        if len(failures) > 1:
            others = ", ".join(f"{r.check} [{r.mode}]" for r in failures[1:])
            first.args = (f"{first.args[0]}\n  also failed: {others}",)
        raise first

    def summary(self) -> str:
        """One line per (check, mode): PASS/FAIL, seconds, and the failed rule."""
        lines = [f"tandem conformance of {self.plugin!r}:"]
        for r in self.results:
            status = "PASS" if r.passed else "FAIL"
            why = f"  {r.error.invariant}" if r.error is not None else ""
            lines.append(f"  {status} {r.check:<18} [{r.mode:<5}] {r.seconds:6.2f}s{why}")
        return "\n".join(lines)


# Workloads ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload (greedy unless `temperature` is set; then seeded).

    Event times count completed steps: `arrival=3` adds the request after the third step
    (0: before the first); `abort_at` queues an abort at such a point (the kernel drains it
    at the start of the next step); `abort_in_flight_at=k` queues it inside step k + 1,
    right after that step was scheduled, so the kernel drains it while that step is in
    flight (sync: before its `update_from_output`; async: before the previous step's, with
    two steps in flight, or at the start of the next step when the queue had room).
    Aborting a request that already finished is ignored (it keeps its finish reason)."""

    rid: str
    prompt: tuple[int, ...]
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    seed: int | None = None
    arrival: int = 0
    abort_at: int | None = None
    abort_in_flight_at: int | None = None
    #: The request's `grammar_ready()` is False until this many steps have completed
    #: (None: no grammar to wait for).
    ready_at: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def aborted(self) -> bool:
        return self.abort_at is not None or self.abort_in_flight_at is not None

    def make(self) -> Request:
        """A fresh `Request` (greedy unless `temperature` is set, then seeded)."""
        params: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": list(self.stop_token_ids),
            "temperature": self.temperature,
        }
        if not self.greedy:
            params["seed"] = self.seed
        return make_request(self.rid, list(self.prompt), eos_token_id=EOS, **params)


@dataclass(frozen=True, eq=False)
class Workload:
    """Requests and engine limits (config overrides of `scripted_config`).

    `enforce_wait_bound` turns on the bounded-wait rule (the workload must satisfy the
    regime in the module docstring; `run_workload` checks it). `max_steps` overrides
    `step_cap()`.
    """

    name: str
    requests: tuple[RequestSpec, ...]
    limits: Mapping[str, Any]
    enforce_wait_bound: bool = False
    max_steps: int | None = None

    def last_event(self) -> int:
        return max(
            max(s.arrival, s.abort_at or 0, s.abort_in_flight_at or 0) for s in self.requests
        )

    def step_cap(self) -> int:
        """Steps within which every request must finish: the last event, plus twice the
        tokens of all requests (a scheduler that computes one token per step needs them
        once), plus 4 per request and 32 (async pipeline steps, fence waits)."""
        if self.max_steps is not None:
            return self.max_steps
        tokens = sum(len(s.prompt) + s.max_tokens for s in self.requests)
        return self.last_event() + 2 * tokens + 4 * len(self.requests) + 32

    def max_prompt_len(self) -> int:
        return max(len(s.prompt) for s in self.requests)

    def max_max_tokens(self) -> int:
        return max(s.max_tokens for s in self.requests)


def wait_bound(num_ahead: int, workload: Workload, async_scheduling: bool) -> int:
    """Steps within which a request with `num_ahead` unfinished requests added before it
    must be first scheduled: `ceil(N * P / (B - S + 1)) + floor(N * (M + a) / S)` (see the
    module docstring for the derivation and its regime)."""
    limits = workload.limits
    seqs = int(limits["max_num_seqs"])
    budget = int(limits["max_num_batched_tokens"])
    prompt = workload.max_prompt_len()
    max_tokens = workload.max_max_tokens()
    a = 1 if async_scheduling else 0
    return math.ceil(num_ahead * prompt / (budget - seqs + 1)) + (
        num_ahead * (max_tokens + a) // seqs
    )


def check_wait_bound_regime(workload: Workload) -> None:
    """Raise ValueError unless `workload` is in the regime where `wait_bound` is sound."""
    limits = workload.limits
    where = f"workload {workload.name!r}"
    seqs, budget = int(limits["max_num_seqs"]), int(limits["max_num_batched_tokens"])
    block_size, num_blocks = int(limits["block_size"]), int(limits["num_kv_blocks"])
    prompt, max_tokens = workload.max_prompt_len(), workload.max_max_tokens()
    if limits.get("scheduling_policy", "fcfs") != "fcfs":
        raise ValueError(f"{where}: the waiting bound needs the fcfs policy")
    if budget < seqs + 1:
        raise ValueError(f"{where}: the waiting bound needs max_num_batched_tokens >= S + 1")
    if limits.get("long_prefill_token_threshold", 0):
        raise ValueError(f"{where}: the waiting bound needs no long_prefill_token_threshold")
    if num_blocks < 3 * seqs * math.ceil((prompt + max_tokens) / block_size):
        raise ValueError(f"{where}: the waiting bound needs >= 3 * S * ceil((P + M) / bs) blocks")
    if prompt + max_tokens >= int(limits["max_model_len"]):
        raise ValueError(f"{where}: the waiting bound needs P + M < max_model_len")
    if any(s.aborted for s in workload.requests):
        raise ValueError(f"{where}: the waiting bound needs a workload without aborts")


def _greedy_tokens(prompt: Sequence[int], n: int) -> list[int]:
    """The scripted model's first `n` greedy tokens after `prompt`, ignoring every stop."""
    history = list(prompt)
    for _ in range(n):
        history.append(scripted_next_token(history, VOCAB))
    return history[len(prompt) :]


def _random_requests(
    seed: int,
    n: int,
    max_prompt: int,
    max_tokens: int,
    max_arrival: int,
    num_seeded: int = 0,
    prefix: str = "r",
) -> tuple[RequestSpec, ...]:
    """`n` requests from a seeded generator: prompts over a small alphabet sharing stems
    (prefix-cache hits), mixed `max_tokens`, `min_tokens`, `ignore_eos`, stop tokens the
    request will produce (it stops mid-stream), staggered arrivals; the last `num_seeded`
    sample at `SEEDED_TEMPERATURE` with a seed."""
    rng = random.Random(seed)
    alphabet = [2, 3, 5, 7, 11, 13]
    stems = [[rng.choice(alphabet) for _ in range(rng.randint(2, max_prompt))] for _ in range(3)]
    specs = []
    for i in range(n):
        stem = rng.choice(stems)
        length = rng.randint(1, max_prompt)
        keep = rng.randint(0, min(length, len(stem)))
        prompt = stem[:keep] + [rng.choice(alphabet) for _ in range(length - keep)]
        tokens = rng.randint(1, max_tokens)
        seeded = i >= n - num_seeded
        stop: tuple[int, ...] = ()
        if not seeded and rng.random() < 0.3:
            own = _greedy_tokens(prompt, tokens)
            stop = (own[rng.randint(0, len(own) - 1)],)
        specs.append(
            RequestSpec(
                rid=f"{prefix}{i}",
                prompt=tuple(prompt),
                max_tokens=tokens,
                min_tokens=min(rng.choice([0, 0, 0, 1, 3]), tokens),
                ignore_eos=rng.random() < 0.5,
                stop_token_ids=stop,
                temperature=SEEDED_TEMPERATURE if seeded else 0.0,
                seed=rng.randint(0, 2**31 - 1) if seeded else None,
                arrival=rng.choice([0, rng.randint(0, max_arrival)]),
            )
        )
    return tuple(specs)


def _limits(**overrides: Any) -> dict[str, Any]:
    limits: dict[str, Any] = {
        "max_model_len": 64,
        "block_size": 4,
        "num_kv_blocks": 64,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        "enable_prefix_caching": True,
        "scheduling_policy": "fcfs",
    }
    limits.update(overrides)
    return limits


def _greedy_parity_workloads() -> tuple[Workload, ...]:
    requests = _random_requests(101, 12, 30, 24, 10, num_seeded=3, prefix="p")
    # One long prompt that is chunked (budget 24) and hits the max_model_len cap.
    capped = RequestSpec("p-capped", tuple(([2, 3, 5, 7] * 23)[:90]), max_tokens=20, arrival=2)
    return (
        Workload(
            "parity",
            (*requests, capped),
            _limits(max_model_len=96, num_kv_blocks=128, max_num_batched_tokens=24),
        ),
        Workload(
            "parity-wide",
            _random_requests(102, 16, 40, 30, 6, num_seeded=4, prefix="v"),
            _limits(
                max_model_len=80,
                block_size=3,
                num_kv_blocks=160,
                max_num_batched_tokens=40,
                max_num_seqs=8,
                enable_prefix_caching=False,
            ),
        ),
    )


def _invariant_workloads() -> tuple[Workload, ...]:
    return (
        # Budget 5: every prompt is chunked; 32 blocks of 2 = one max-length sequence.
        Workload(
            "tiny-budget",
            _random_requests(202, 10, 24, 20, 8, prefix="t"),
            _limits(block_size=2, num_kv_blocks=32, max_num_batched_tokens=5, max_num_seqs=6),
        ),
        # Odd block size, no prefix caching, three sequences, pool of 1.5 sequences.
        Workload(
            "odd-blocks",
            _random_requests(203, 10, 30, 30, 12, prefix="o"),
            _limits(
                max_model_len=80,
                block_size=5,
                num_kv_blocks=24,
                max_num_batched_tokens=16,
                max_num_seqs=3,
                enable_prefix_caching=False,
            ),
        ),
        # One-token blocks, budget 3 (below the number of sequences), eight sequences.
        Workload(
            "one-token-blocks",
            _random_requests(204, 12, 16, 16, 10, prefix="u"),
            _limits(block_size=1, num_kv_blocks=80, max_num_batched_tokens=3, max_num_seqs=8),
        ),
        # Large blocks, a long-prefill threshold, a pool of two sequences.
        Workload(
            "large-blocks",
            _random_requests(205, 12, 40, 24, 10, prefix="g"),
            _limits(
                block_size=8,
                num_kv_blocks=16,
                max_num_batched_tokens=32,
                max_num_seqs=5,
                long_prefill_token_threshold=6,
            ),
        ),
    )


def _kv_leak_workloads() -> tuple[Workload, ...]:
    first = _random_requests(303, 8, 20, 16, 3, prefix="a")
    stem = (3, 5, 7, 2, 3, 5, 7, 2, 11)
    twins = tuple(
        RequestSpec(f"twin{i}", stem + (13,) * (i % 2), max_tokens=6 + i, arrival=i)
        for i in range(4)
    )
    # The second wave arrives long after the first has finished: the engine is idle in
    # between, and every block must be free then.
    second = tuple(
        RequestSpec(s.rid.replace("a", "b", 1), s.prompt, s.max_tokens, arrival=150 + s.arrival)
        for s in first
    )
    return (
        Workload(
            "two-waves",
            (*first, *twins, *second),
            _limits(max_model_len=48, block_size=3, num_kv_blocks=30, max_num_seqs=5),
        ),
    )


def _all_finish_workloads() -> tuple[Workload, ...]:
    first_token = _greedy_tokens([7, 3, 2], 1)[0]
    min_stop = _greedy_tokens([5, 5, 3, 2], 5)
    requests = (
        RequestSpec("len-cap", tuple(([2, 3, 5] * 21)[:62]), max_tokens=10),
        RequestSpec("one-token", (3, 5, 7), max_tokens=1),
        RequestSpec("prompt-1", (7,), max_tokens=12, arrival=1),
        RequestSpec("stop-first", (7, 3, 2), max_tokens=8, stop_token_ids=(first_token,)),
        RequestSpec(
            "min-tokens",
            (5, 5, 3, 2),
            max_tokens=9,
            min_tokens=5,
            stop_token_ids=(min_stop[0], min_stop[2]),
        ),
        RequestSpec("long", (2, 2, 3), max_tokens=40, ignore_eos=True, arrival=2),
        RequestSpec("block-exact", (2, 3, 5, 7, 11, 13, 2, 3), max_tokens=5, arrival=3),
        RequestSpec("same-a", (11, 7, 5, 3, 2, 11, 7, 5, 3, 2, 11, 7), max_tokens=6, arrival=4),
        RequestSpec("same-b", (11, 7, 5, 3, 2, 11, 7, 5, 3, 2, 11, 7), max_tokens=6, arrival=9),
        RequestSpec("late", (13, 11, 7), max_tokens=3, arrival=25),
    )
    return (
        Workload(
            "edge-cases",
            requests,
            _limits(num_kv_blocks=48, max_num_batched_tokens=16, max_num_seqs=3),
        ),
    )


def _steady_arrivals(
    name: str, seed: int, n: int, prompt: tuple[int, int], max_tokens: tuple[int, int], every: float
) -> tuple[RequestSpec, ...]:
    """`n` requests (ignore_eos, so their lengths are known), one every `every` steps."""
    rng = random.Random(seed)
    return tuple(
        RequestSpec(
            f"{name}{i}",
            tuple(rng.choice([2, 3, 5, 7, 11]) for _ in range(rng.randint(*prompt))),
            max_tokens=rng.randint(*max_tokens),
            ignore_eos=True,
            arrival=int(i * every),
        )
        for i in range(n)
    )


def _bounded_wait_workloads() -> tuple[Workload, ...]:
    # Arrivals slightly faster than the engine serves them: a queue builds up and never
    # drains until the arrivals stop, so a LIFO scheduler keeps passing over the oldest.
    return (
        Workload(
            "steady-arrivals",
            _steady_arrivals("w", 505, 40, (4, 14), (3, 8), 1.5),
            _limits(
                num_kv_blocks=72,
                max_num_batched_tokens=10,
                max_num_seqs=4,
                enable_prefix_caching=False,
            ),
            enforce_wait_bound=True,
        ),
        Workload(
            "steady-arrivals-two-seqs",
            _steady_arrivals("z", 506, 30, (8, 20), (2, 6), 2.0),
            _limits(
                num_kv_blocks=48,
                max_num_batched_tokens=24,
                max_num_seqs=2,
                enable_prefix_caching=False,
            ),
            enforce_wait_bound=True,
        ),
    )


def _abort_workloads() -> tuple[Workload, ...]:
    base = _random_requests(606, 12, 20, 20, 6, prefix="x")
    # Abort times are offsets from each request's arrival.
    events: dict[str, dict[str, int]] = {
        "x0": {"abort_at": 0},  # WAITING, aborted before it is ever scheduled
        "x1": {"abort_at": 2},
        "x2": {"abort_in_flight_at": 1},
        "x3": {"abort_in_flight_at": 3},
        "x4": {"abort_at": 5},
        "x5": {"abort_in_flight_at": 6},
        "x6": {"abort_at": 60},  # most likely already finished: the abort is ignored
    }
    aborted = tuple(
        replace(s, **{k: s.arrival + v for k, v in events.get(s.rid, {}).items()}) for s in base
    )
    long_prompt = tuple(([3, 5, 7, 11] * 10)[:38])
    chunked = (
        # A long prompt under budget 8: aborted while its prefill is chunked.
        RequestSpec("chunked", long_prompt, max_tokens=10, arrival=1, abort_in_flight_at=3),
        RequestSpec("decoding", (2, 3, 5), max_tokens=30, ignore_eos=True, abort_at=12),
    )
    return (
        Workload(
            "aborts",
            (*aborted, *chunked),
            _limits(num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=4),
        ),
        # A pool of one sequence: aborts also hit preempted (WAITING) requests.
        Workload(
            "aborts-preempting",
            tuple(replace(s, rid=f"pre-{s.rid}") for s in (*aborted, *chunked)),
            _limits(num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=6),
        ),
    )


def _preemption_workloads() -> tuple[Workload, ...]:
    return (
        Workload(
            "one-sequence-pool",
            _random_requests(707, 10, 24, 30, 6, prefix="q"),
            _limits(num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=6),
        ),
        Workload(
            "one-sequence-pool-eight-seqs",
            _random_requests(709, 14, 20, 24, 4, prefix="e"),
            _limits(block_size=2, num_kv_blocks=32, max_num_batched_tokens=64, max_num_seqs=8),
        ),
        Workload(
            "one-sequence-pool-no-prefix",
            _random_requests(708, 10, 24, 30, 6, prefix="s"),
            _limits(
                max_model_len=60,
                block_size=3,
                num_kv_blocks=20,
                max_num_batched_tokens=12,
                max_num_seqs=5,
                enable_prefix_caching=False,
            ),
        ),
    )


def _grammar_ready_workloads() -> tuple[Workload, ...]:
    base = _random_requests(808, 8, 16, 12, 4, prefix="g")
    # g0 and g3 wait for their grammar; g1, g2 (behind g0) and the rest must not wait.
    waits = {"g0": 12, "g3": 6}
    requests = tuple(
        replace(s, ready_at=s.arrival + waits[s.rid]) if s.rid in waits else s for s in base
    )
    return (
        Workload(
            "grammar-ready",
            requests,
            _limits(num_kv_blocks=96, max_num_batched_tokens=32, max_num_seqs=4),
        ),
        Workload(
            "grammar-ready-small-pool",
            tuple(replace(s, rid=f"p-{s.rid}") for s in requests),
            _limits(num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4),
        ),
    )


@dataclass(frozen=True)
class Check:
    """A named check: what it verifies (beyond the per-step rules) and its workloads."""

    name: str
    summary: str
    workloads: tuple[Workload, ...]


CHECK_LIST: tuple[Check, ...] = (
    Check(
        "greedy-parity",
        "greedy outputs equal the scripted reference; seeded outputs equal the reference "
        "scheduler's",
        _greedy_parity_workloads(),
    ),
    Check(
        "ledger-invariants",
        "ledger, placeholder, KV and scheduling invariants after every step, under stress",
        _invariant_workloads(),
    ),
    Check("kv-no-leak", "every KV block free whenever the engine is idle", _kv_leak_workloads()),
    Check(
        "all-finish",
        "every request finishes, with the right reason, within the step cap",
        _all_finish_workloads(),
    ),
    Check(
        "bounded-wait",
        "no request waits longer than wait_bound(N) steps under steady load",
        _bounded_wait_workloads(),
    ),
    Check(
        "abort",
        "aborts (also in flight) end requests with 'abort', others exact, no leak",
        _abort_workloads(),
    ),
    Check(
        "preemption",
        "preemption by recompute keeps outputs exact and leaks nothing",
        _preemption_workloads(),
    ),
    Check(
        "grammar-ready",
        "a request is not scheduled while its grammar_ready() is False, and blocks no one",
        _grammar_ready_workloads(),
    ),
)
#: The check names, in run order.
CHECKS: tuple[str, ...] = tuple(c.name for c in CHECK_LIST)
_CHECKS_BY_NAME = {c.name: c for c in CHECK_LIST}


# Driving an engine ----------------------------------------------------------------------


@dataclass
class RunResult:
    """What one workload run produced: per request the tokens and the finish reason, the
    steps taken, preemptions seen in `SchedulerOutput.preempted_req_ids`, the steps at
    which the engine was idle before the workload's last event, requests that
    ended with "abort" (and of those, the ones that had been scheduled), and per request
    the steps it waited before it was first scheduled and its `wait_bound` (when
    enforced)."""

    outputs: Outputs
    steps: int
    preemptions: int
    idle_points: int
    aborted: int
    aborted_after_scheduling: int
    waits: dict[str, int]
    wait_bounds: dict[str, int]

    @property
    def max_wait_ratio(self) -> float:
        """The largest wait / bound over the requests with a bound (0 when none)."""
        ratios = [self.waits[r] / max(b, 1) for r, b in self.wait_bounds.items() if r in self.waits]
        return max(ratios, default=0.0)


def stack_for(plugin: str, options: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The stack a conformance engine runs: the plugin as scheduler, then the default
    sampler (the async layer is inserted by the plugin manager when async is on)."""
    return [{"name": plugin, "options": dict(options or {})}, {"name": "default-sampler"}]


class _Probe:
    """Registered on a conformance engine's plugin manager after the stack loaded: checks
    the `schedule` and `update_after_schedule` contracts around the plugin's calls and
    queues the workload's in-flight aborts."""

    def __init__(self, driver: _Driver) -> None:
        self.driver = driver
        self.after_schedule: dict[str, tuple[int, int]] = {}

    @hookimpl(wrapper=True)
    def schedule(self) -> Generator[None, SchedulerOutput, SchedulerOutput]:
        driver = self.driver
        state = driver.state()
        running_before = {r.request_id: r.num_computed_tokens for r in state.running}
        output = yield
        driver.check_schedule(output, running_before)
        self.after_schedule = {
            rid: (
                driver.requests[rid].num_computed_tokens,
                driver.requests[rid].num_in_flight_tokens,
            )
            for rid in output.num_scheduled_tokens
        }
        return output

    @hookimpl(trylast=True)
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        self.driver.check_update_after_schedule(scheduler_output, self.after_schedule)
        self.driver.queue_in_flight_aborts()


_VIOLATION = re.compile(r"^(?:KV: )?(?P<inv>.+?) violated(?: by (?P<rid>[^\s:]+))?")
_KV_REQUEST = re.compile(r"request (?P<rid>[^\s:,]+)")


class _Driver:
    """Runs one workload on one engine, step by step, checking every rule."""

    def __init__(
        self,
        plugin: str,
        options: Mapping[str, Any] | None,
        workload: Workload,
        mode: Mode,
        check: str,
        seeded_expected: Outputs | None,
    ) -> None:
        self.plugin = plugin
        self.workload = workload
        self.mode = mode
        self.check = check
        self.seeded_expected = seeded_expected
        self.step = 0
        self.requests: dict[str, Request] = {}
        self.specs = {s.rid: s for s in workload.requests}
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.arrival: dict[str, int] = {}
        self.first_scheduled: dict[str, int] = {}
        self.wait_bounds: dict[str, int] = {}
        self.preemptions = 0
        self.idle_points = 0
        if workload.enforce_wait_bound:
            check_wait_bound_regime(workload)
        try:
            config = scripted_config(
                vocab_size=VOCAB,
                eos_token_id=EOS,
                check_invariants=True,
                async_scheduling=mode == "async",
                plugins=stack_for(plugin, options),
                **workload.limits,
            )
            self.engine = EngineCore(config)
        except Exception as exc:
            raise self.error("the stack loads and starts", f"{type(exc).__name__}: {exc}") from exc
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.engine.plugin_manager.register(_Probe(self), name="tandem-conformance-probe")

    # Reporting ---------------------------------------------------------------------
    def error(self, invariant: str, detail: str, request_id: str | None = None) -> ConformanceError:
        request = self.requests.get(request_id) if request_id is not None else None
        return ConformanceError(
            plugin=self.plugin,
            check=self.check,
            mode=self.mode,
            workload=self.workload.name,
            step=self.step,
            invariant=invariant,
            detail=detail,
            request_id=request_id,
            ledger=request.ledger() if request is not None else None,
        )

    def from_violation(self, exc: InvariantViolation) -> ConformanceError:
        """The kernel's invariant message, with the invariant and the request pulled out."""
        problems = str(exc).splitlines()[1:] or [str(exc)]
        first = problems[0]
        match = _VIOLATION.match(first)
        invariant = match.group("inv") if match else first.split(":")[0]
        rid = match.group("rid") if match else None
        if rid is None:
            kv_match = _KV_REQUEST.search(first)
            rid = kv_match.group("rid") if kv_match else None
        if first.startswith("KV: "):
            invariant = "KV: " + invariant
        known = rid if rid in self.requests else None
        if known is not None:  # its ledger is printed below the detail
            problems[0] = re.sub(r": \{.*\}$", "", first)
        return self.error(invariant, "\n    ".join(problems), known)

    def state(self) -> SchedulerState:
        state = self.engine.scheduler_state
        if not isinstance(state, SchedulerState):
            raise self.error(
                "the scheduler answers the scheduler_state hook",
                f"scheduler_state returned {state!r}",
            )
        return state

    # Events -------------------------------------------------------------------------
    def add(self, spec: RequestSpec) -> None:
        request = spec.make()
        if spec.ready_at is not None:
            ready_at = spec.ready_at
            request.grammar_ready = lambda: self.step > ready_at  # `step` is being planned
        num_ahead = sum(1 for rid in self.requests if self.finish.get(rid) is None)
        self.requests[spec.rid] = request
        self.tokens[spec.rid] = []
        self.finish[spec.rid] = None
        self.arrival[spec.rid] = self.step
        if self.workload.enforce_wait_bound:
            self.wait_bounds[spec.rid] = wait_bound(num_ahead, self.workload, self.mode == "async")
        try:
            self.engine.add_request(request)
        except Exception as exc:
            raise self.error(
                "add_request accepts a valid request", f"{type(exc).__name__}: {exc}", spec.rid
            ) from exc

    def queue_in_flight_aborts(self) -> None:
        ids = [s.rid for s in self.workload.requests if s.abort_in_flight_at == self.step - 1]
        if ids:
            self.engine.abort_requests(ids)

    # Rules --------------------------------------------------------------------------
    def check_schedule(self, output: object, running_before: Mapping[str, int]) -> None:
        """The `schedule` contract, right after the plugin answered."""
        if not isinstance(output, SchedulerOutput):
            raise self.error("schedule returns a SchedulerOutput", f"got {output!r}")
        state = self.state()
        scheduled = output.num_scheduled_tokens
        for rid in scheduled:
            self.first_scheduled.setdefault(rid, self.step)
        if output.preempted_req_ids:
            self.preemptions += len(output.preempted_req_ids)
            if output.scheduled_new_reqs:
                admitted = output.scheduled_new_reqs[0].req_id
                raise self.error(
                    "no WAITING request is admitted in a step that preempted",
                    f"{admitted} admitted while {sorted(output.preempted_req_ids)} "
                    f"were preempted in the same step",
                    admitted,
                )
        for rid, n in scheduled.items():
            ready_at = self.specs[rid].ready_at if rid in self.specs else None
            if ready_at is not None and self.step <= ready_at:
                raise self.error(
                    "a request is not scheduled while its grammar_ready() is False",
                    f"{rid} scheduled in step {self.step}; its grammar is ready after step "
                    f"{ready_at}",
                    rid,
                )
            request = self.requests.get(rid)
            if request is None or rid not in state.requests or request.is_finished:
                raise self.error(
                    "only live requests are scheduled",
                    f"{rid} scheduled for {n} tokens but it is not a live request",
                    rid,
                )
            if n <= 0:
                raise self.error(
                    "every scheduled request gets num_scheduled_tokens > 0",
                    f"{rid} scheduled for {n} tokens",
                    rid,
                )
            work = (
                request.num_tokens_with_spec
                + request.num_output_placeholders
                - request.num_computed_tokens
            )
            if n > work:
                raise self.error(
                    "num_scheduled_tokens <= num_tokens_with_spec + num_output_placeholders "
                    "- num_computed_tokens",
                    f"{rid} scheduled for {n} tokens, its outstanding work is {work}",
                    rid,
                )
        total = sum(scheduled.values())
        if output.total_num_scheduled_tokens != total:
            raise self.error(
                "total_num_scheduled_tokens == sum(num_scheduled_tokens)",
                f"total_num_scheduled_tokens {output.total_num_scheduled_tokens} != {total}",
            )
        if total > self.max_num_batched_tokens:
            raise self.error(
                "total_num_scheduled_tokens <= max_num_batched_tokens",
                f"{total} tokens scheduled, budget {self.max_num_batched_tokens}",
            )
        if len(state.running) > self.max_num_seqs:
            raise self.error(
                "at most max_num_seqs requests RUNNING",
                f"{len(state.running)} RUNNING, max_num_seqs {self.max_num_seqs}",
                state.running[-1].request_id,
            )
        named = [r.req_id for r in output.scheduled_new_reqs]
        named += [r.req_id for r in output.scheduled_cached_reqs]
        if sorted(named) != sorted(scheduled):
            raise self.error(
                "scheduled_new_reqs and scheduled_cached_reqs name exactly the scheduled requests",
                f"they name {sorted(named)}, num_scheduled_tokens has {sorted(scheduled)}",
            )
        for rid, computed in running_before.items():
            request = self.requests.get(rid)
            if (
                request is not None
                and not request.is_finished
                and rid not in output.preempted_req_ids
                and request.num_computed_tokens != computed
            ):
                raise self.error(
                    "schedule does not advance num_computed_tokens (update_after_schedule does)",
                    f"{rid}: num_computed_tokens {computed} -> {request.num_computed_tokens} "
                    f"during schedule",
                    rid,
                )

    def check_update_after_schedule(
        self, output: SchedulerOutput, after_schedule: Mapping[str, tuple[int, int]]
    ) -> None:
        """The `update_after_schedule` contract, after every plugin of the stack ran."""
        for rid, n in output.num_scheduled_tokens.items():
            request = self.requests[rid]
            computed, in_flight = after_schedule[rid]
            if request.num_computed_tokens != computed + n:
                raise self.error(
                    "update_after_schedule adds num_scheduled_tokens to num_computed_tokens",
                    f"{rid}: {computed} + {n} scheduled -> {request.num_computed_tokens}",
                    rid,
                )
            if request.num_in_flight_tokens != in_flight + n:
                raise self.error(
                    "update_after_schedule adds num_scheduled_tokens to num_in_flight_tokens",
                    f"{rid}: {in_flight} + {n} scheduled -> {request.num_in_flight_tokens}",
                    rid,
                )

    def check_after_step(self) -> None:
        """Ledger, placeholder and KV rules after a step, and the idle state when idle."""
        state = self.state()
        idle = not self.engine.has_work()
        try:
            check_invariants(state, self.step, idle=False)
        except InvariantViolation as exc:
            raise self.from_violation(exc) from exc
        for rid, request in state.requests.items():
            if self.mode == "sync" and request.num_output_placeholders != 0:
                raise self.error(
                    "no output placeholders under sync scheduling",
                    f"{rid} has {request.num_output_placeholders} placeholders",
                    rid,
                )
            if request.num_output_placeholders > request.num_in_flight_tokens:
                raise self.error(
                    "num_output_placeholders <= num_in_flight_tokens (a step's placeholders "
                    "are resolved when its result is processed)",
                    f"{rid} has {request.num_output_placeholders} placeholders but only "
                    f"{request.num_in_flight_tokens} tokens in flight",
                    rid,
                )
        kv = state.kv_cache_manager
        for rid, blocks in kv.req_to_blocks.items():
            live = state.requests.get(rid)
            if blocks and (live is None or live.is_finished):
                raise self.error(
                    "KV blocks are held only by live requests (finishing or aborting a "
                    "request frees its blocks through the fence)",
                    f"{rid} holds blocks {[b.block_id for b in blocks]} but is no live "
                    f"request of the scheduler",
                    rid,
                )
        if self.workload.enforce_wait_bound:
            self.check_waits()
        if idle:
            self.check_idle(state)

    def check_waits(self) -> None:
        for rid, bound in self.wait_bounds.items():
            if rid in self.first_scheduled or self.finish.get(rid) is not None:
                continue
            waited = self.step - self.arrival[rid]
            if waited > bound:
                raise self.error(
                    "bounded wait: first scheduled within ceil(N * P / (B - S + 1)) + "
                    "floor(N * (M + a) / S) steps of arrival",
                    f"{rid} not scheduled in the {waited} steps since it arrived (after "
                    f"step {self.arrival[rid]}); bound {bound}",
                    rid,
                )

    def check_idle(self, state: SchedulerState) -> None:
        if state.requests or state.waiting or state.running:
            rid = next(iter(state.requests), None)
            raise self.error(
                "an idle scheduler holds no requests",
                f"registry {sorted(state.requests)}, {len(state.waiting)} WAITING, "
                f"{len(state.running)} RUNNING",
                rid,
            )
        kv = state.kv_cache_manager
        if not kv.all_blocks_free():
            holders = {rid: len(b) for rid, b in kv.req_to_blocks.items() if b}
            raise self.error(
                "every KV block is free when the engine is idle",
                f"{kv.num_free_blocks} of {kv.num_blocks} blocks free, "
                f"{kv.num_fenced_blocks} waiting for a fence, held by {holders}",
                next(iter(holders), None),
            )

    def take_outputs(self, outputs: Sequence[EngineCoreOutput]) -> None:
        for out in outputs:
            rid = out.request_id
            if rid not in self.requests:
                raise self.error(
                    "outputs only for requests in the engine", f"output for unknown {rid}: {out}"
                )
            if self.finish[rid] is not None:
                raise self.error(
                    "no output after a request finished",
                    f"{rid} finished ({self.finish[rid]}) and then got {out}",
                    rid,
                )
            if out.finish_reason not in (None, "stop", "length", "abort"):
                raise self.error("finish reasons are stop, length or abort", f"{rid}: {out}", rid)
            self.tokens[rid].extend(out.new_token_ids)
            self.finish[rid] = out.finish_reason

    # The loop -----------------------------------------------------------------------
    def run(self) -> RunResult:
        workload = self.workload
        last_event = workload.last_event()
        cap = workload.step_cap()
        try:
            while True:
                for spec in workload.requests:
                    if spec.arrival == self.step:
                        self.add(spec)
                    if spec.abort_at == self.step:
                        self.engine.abort_requests([spec.rid])
                if not self.engine.has_work():
                    self.check_idle(self.state())
                    if self.step >= last_event:
                        break
                    self.idle_points += 1
                    self.step += 1  # nothing to do until the next arrival
                    continue
                if self.step >= cap:
                    unfinished = [rid for rid, r in self.finish.items() if r is None]
                    raise self.error(
                        "every request finishes within the step cap",
                        f"{len(unfinished)} requests unfinished after {cap} steps: "
                        f"{unfinished[:8]}",
                        unfinished[0] if unfinished else None,
                    )
                self.step += 1
                try:
                    outputs, _ = self.engine.step_fn()
                except ConformanceError:
                    raise
                except InvariantViolation as exc:
                    raise self.from_violation(exc) from exc
                except Exception as exc:
                    frame = traceback.extract_tb(exc.__traceback__)[-1]
                    raise self.error(
                        "the engine step raises no exception",
                        f"{type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})",
                    ) from exc
                self.take_outputs(outputs)
                self.check_after_step()
            self.check_end()
        finally:
            self.engine.shutdown()
        aborted = [rid for rid, reason in self.finish.items() if reason == "abort"]
        return RunResult(
            outputs={rid: (self.tokens[rid], self.finish[rid]) for rid in self.requests},
            steps=self.step,
            preemptions=self.preemptions,
            idle_points=self.idle_points,
            aborted=len(aborted),
            aborted_after_scheduling=sum(1 for rid in aborted if rid in self.first_scheduled),
            waits={
                rid: self.first_scheduled[rid] - 1 - self.arrival[rid]
                for rid in self.requests
                if rid in self.first_scheduled
            },
            wait_bounds=dict(self.wait_bounds),
        )

    def check_not_blocked(self) -> None:
        """Each request waiting for its grammar let a request added after it run first."""
        requests = self.workload.requests
        for i, spec in enumerate(requests):
            if spec.ready_at is None:
                continue
            behind = [  # added after it (same step: later in the list), needing no grammar
                other.rid
                for j, other in enumerate(requests)
                if other.ready_at is None
                and (other.arrival, j) > (spec.arrival, i)
                and other.arrival < spec.ready_at
            ]
            if behind and not any(
                self.first_scheduled.get(rid, 1 << 30) <= spec.ready_at for rid in behind
            ):
                raise self.error(
                    "a request waiting for its grammar does not block the requests behind it",
                    f"{spec.rid} waited for its grammar until step {spec.ready_at}; none of "
                    f"{behind} was scheduled before then",
                    spec.rid,
                )

    def check_end(self) -> None:
        self.check_not_blocked()
        if self.engine.batch_queue:
            raise self.error(
                "no step is left in flight when idle",
                f"{len(self.engine.batch_queue)} steps queued",
            )
        self.check_idle(self.state())
        for spec in self.workload.requests:
            rid = spec.rid
            tokens, reason = self.tokens[rid], self.finish[rid]
            if reason is None:
                raise self.error("every request finishes", f"{rid} never finished", rid)
            expected = self.expected(spec)
            if expected is None:
                continue
            want_tokens, want_reason = expected
            if spec.aborted and want_reason == "abort":
                # A seeded request the reference run aborted too: only a common prefix
                # is known.
                common = min(len(tokens), len(want_tokens))
                if tokens[:common] != want_tokens[:common]:
                    raise self.error(
                        "seeded outputs equal the reference (a scheduler may change timing, "
                        "never tokens)",
                        f"{rid}: got {tokens} ({reason}), the reference run gave "
                        f"{want_tokens} (abort)",
                        rid,
                    )
            elif spec.aborted and reason == "abort":
                if len(tokens) >= len(want_tokens) or tokens != want_tokens[: len(tokens)]:
                    raise self.error(
                        "an aborted request's tokens are a strict prefix of its exact output",
                        f"{rid}: got {tokens}, exact output {want_tokens} ({want_reason})",
                        rid,
                    )
            elif (tokens, reason) != (want_tokens, want_reason):
                diverge = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(tokens, want_tokens, strict=False))
                        if a != b
                    ),
                    min(len(tokens), len(want_tokens)),
                )
                kind = "greedy" if spec.greedy else "seeded"
                raise self.error(
                    f"{kind} outputs equal the reference (a scheduler may change timing, "
                    f"never tokens)",
                    f"{rid}: got {tokens} ({reason}), want {want_tokens} ({want_reason}); "
                    f"first difference at output {diverge}",
                    rid,
                )

    def expected(self, spec: RequestSpec) -> tuple[list[int], str | None] | None:
        if spec.greedy:
            params = spec.make().sampling_params
            max_model_len = self.engine.max_model_len
            return expected_scripted_output(list(spec.prompt), params, VOCAB, EOS, max_model_len)
        if self.seeded_expected is None:
            return None
        return self.seeded_expected[spec.rid]


def run_workload(
    plugin: str,
    workload: Workload,
    mode: Mode = "sync",
    options: Mapping[str, Any] | None = None,
    check: str = "workload",
    seeded_expected: Outputs | None = None,
) -> RunResult:
    """Run `workload` with `plugin` (an entry-point name) as the scheduler in `mode`,
    checking every per-step rule; raise `ConformanceError` (reported under `check`) on the
    first violation. Greedy requests are compared with `expected_scripted_output`, seeded
    ones with `seeded_expected` when given."""
    return _Driver(plugin, options, workload, mode, check, seeded_expected).run()


_REFERENCE_CACHE: dict[tuple[int, str], Outputs] = {}


def reference_outputs(workload: Workload, mode: Mode = "sync") -> Outputs:
    """Per request, the tokens and finish reason of `workload` on the reference scheduler
    in `mode`: what any conforming scheduler must produce, seeded requests included. The
    built-in workloads' results are cached for the process."""
    builtin = any(workload is w for c in CHECK_LIST for w in c.workloads)
    key = (id(workload), mode)
    if builtin and key in _REFERENCE_CACHE:
        return _REFERENCE_CACHE[key]
    outputs = run_workload(REFERENCE_SCHEDULER, workload, mode, check="reference run").outputs
    if builtin:
        _REFERENCE_CACHE[key] = outputs
    return outputs


# Registering test plugins ---------------------------------------------------------------

_registry_counter = itertools.count()


def _kebab(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()


@contextlib.contextmanager
def registered_plugins(plugins: Mapping[str, type]) -> Iterator[None]:
    """Test-only: make plugin classes discoverable by name through the entry-point group
    `tandem.plugins` for the duration of the block, as if a distribution declaring them
    were installed (a throwaway `.dist-info` on `sys.path` pointing into a synthetic
    module). Names of installed plugins are refused (ValueError). The classes only exist
    in this process: use the in-process executor."""
    clash = sorted(set(plugins) & set(discover_plugins()))
    if clash:
        raise ValueError(f"plugin names already installed: {clash}")
    index = next(_registry_counter)
    module_name = f"_tandem_conformance_registered_{index}"
    module = types.ModuleType(module_name)
    lines = ["[tandem.plugins]"]
    for i, (name, cls) in enumerate(plugins.items()):
        setattr(module, f"plugin_{i}", cls)
        lines.append(f"{name} = {module_name}:plugin_{i}")
    root = Path(tempfile.mkdtemp(prefix="tandem-conformance-"))
    info = root / f"{module_name}-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: tandem-conformance-registered-{index}\nVersion: 0.0\n"
    )
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    sys.modules[module_name] = module
    sys.path.append(str(root))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(str(root))
        sys.modules.pop(module_name, None)
        shutil.rmtree(root, ignore_errors=True)
        importlib.invalidate_caches()


@contextlib.contextmanager
def _plugin_name(plugin: str | type) -> Iterator[str]:
    """The entry-point name to run: `plugin` itself, or a temporary registration of a
    class under `test-<kebab-case class name>`."""
    if isinstance(plugin, str):
        yield plugin
        return
    name = f"test-{_kebab(plugin.__name__)}"
    with registered_plugins({name: plugin}):
        yield name


# Running checks -------------------------------------------------------------------------


def check_conformance(
    plugin: str | type,
    check: str,
    mode: Mode,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one check in one mode; raise `ConformanceError` on a violation, else return the
    run's details (steps, preemptions, aborts, the largest wait/bound ratio)."""
    if check not in _CHECKS_BY_NAME:
        raise ValueError(f"unknown check {check!r}; checks: {', '.join(CHECKS)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    details: dict[str, Any] = {
        "steps": 0,
        "preemptions": 0,
        "idle_points": 0,
        "aborted": 0,
        "aborted_after_scheduling": 0,
        "max_wait_ratio": 0.0,
    }
    with _plugin_name(plugin) as name:
        for workload in _CHECKS_BY_NAME[check].workloads:
            seeded = None
            if any(not s.greedy for s in workload.requests):
                seeded = reference_outputs(workload, mode)
            result = run_workload(name, workload, mode, options, check, seeded)
            details["steps"] += result.steps
            details["preemptions"] += result.preemptions
            details["idle_points"] += result.idle_points
            details["aborted"] += result.aborted
            details["aborted_after_scheduling"] += result.aborted_after_scheduling
            details["max_wait_ratio"] = max(details["max_wait_ratio"], result.max_wait_ratio)
    return details


def run_conformance(
    plugin: str | type,
    options: Mapping[str, Any] | None = None,
    checks: Sequence[str] | None = None,
    modes: Sequence[Mode] = MODES,
) -> ConformanceReport:
    """Run every check (or `checks`) in every mode (or `modes`) on the scheduler plugin
    named `plugin` (an entry point of `tandem.plugins`) with `options`; never raises for a
    failed check: see `ConformanceReport.passed` / `raise_for_failures()`.

    `plugin` may also be a plugin class (for tests): it is registered under a temporary
    entry point named `test-<kebab-case class name>` for the run.
    """
    selected = list(checks) if checks is not None else list(CHECKS)
    results: list[CheckResult] = []
    with _plugin_name(plugin) as name:
        for check in selected:
            for mode in modes:
                start = time.perf_counter()
                try:
                    details = check_conformance(name, check, mode, options)
                    error = None
                except ConformanceError as exc:
                    details, error = {}, exc
                results.append(
                    CheckResult(check, mode, error, time.perf_counter() - start, details)
                )
    return ConformanceReport(name, results)


# Ledger traces --------------------------------------------------------------------------


@dataclass
class LedgerStep:
    """One step of `ledger_trace`: the tokens scheduled per request, the outputs, and the
    ledger of every request the scheduler holds after the step."""

    step: int
    scheduled: dict[str, int]
    outputs: list[EngineCoreOutput]
    ledgers: dict[str, dict[str, object]]


class _ScheduleRecorder:
    def __init__(self) -> None:
        self.scheduled: dict[str, int] = {}

    @hookimpl(trylast=True)
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        self.scheduled.update(scheduler_output.num_scheduled_tokens)


def ledger_trace(engine: EngineCore, max_steps: int = 10_000) -> list[LedgerStep]:
    """Step `engine` (`step_fn`) until it has no work and record, per step, what was
    scheduled, the outputs and every request's ledger (`Request.ledger()`) afterwards.
    Raises RuntimeError when the engine is not idle after `max_steps`."""
    recorder = _ScheduleRecorder()
    name = f"tandem-ledger-trace-{id(recorder)}"
    engine.plugin_manager.register(recorder, name=name)
    trace: list[LedgerStep] = []
    try:
        for step in range(1, max_steps + 1):
            if not engine.has_work():
                return trace
            recorder.scheduled = {}
            outputs, _ = engine.step_fn()
            state = engine.scheduler_state
            trace.append(
                LedgerStep(
                    step=step,
                    scheduled=dict(recorder.scheduled),
                    outputs=list(outputs),
                    ledgers={rid: r.ledger() for rid, r in state.requests.items()},
                )
            )
        if not engine.has_work():
            return trace
        raise RuntimeError(f"engine did not become idle within {max_steps} steps")
    finally:
        engine.plugin_manager.unregister(name=name)


def format_ledger_trace(trace: Sequence[LedgerStep]) -> str:
    """A readable dump of a `ledger_trace`: one block per step."""
    lines = []
    for entry in trace:
        lines.append(f"step {entry.step}: scheduled {entry.scheduled}")
        for out in entry.outputs:
            lines.append(f"  out {out.request_id}: {out.new_token_ids} {out.finish_reason or ''}")
        for ledger in entry.ledgers.values():
            lines.append(f"  {ledger}")
    return "\n".join(lines)
