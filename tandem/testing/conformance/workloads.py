"""What a conformance run is made of: requests, workloads, and the waiting bound.

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

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tandem.core.request import Request
from tandem.testing.engine import make_request

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

#: The starvation bound of the `victim-starvation` check: the most times one request may be
#: preempted in its workloads (a long request beside a steady stream of short ones, on a
#: KV pool of one max-length sequence). Measured on those two workloads (deterministic;
#: sync and async): the reference FCFS rule preempts one request at most 3 times,
#: `lrw-victim` with `max_preemptions: 2` at most 4, while rules with no bound preempt the
#: long request far more often: longest remaining work 12-32 times, the largest KV holder
#: 21-47. 8 sits between the two. It is a sampled scenario, not a proof: a rule whose
#: repeats stay few here passes (always preempting the oldest request: 4-7 times).
PREEMPTION_BOUND = 8


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
    #: The request is in `requests_not_ready` until this many steps have completed
    #: (None: no grammar to wait for).
    ready_at: int | None = None
    #: The request must have finished once this many steps have completed (None: only the
    #: workload's step cap applies); the `victim-starvation` check sets it.
    finish_by: int | None = None

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
    `step_cap()`. `max_preemptions_per_request` turns on the starvation rule: no request
    is preempted more often than that (see `PREEMPTION_BOUND`).
    """

    name: str
    requests: tuple[RequestSpec, ...]
    limits: Mapping[str, Any]
    enforce_wait_bound: bool = False
    max_steps: int | None = None
    max_preemptions_per_request: int | None = None

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
