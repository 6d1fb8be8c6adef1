"""The checks and their fixed, seeded workloads (`CHECK_LIST`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tandem.testing.conformance.workloads import (
    PREEMPTION_BOUND,
    SEEDED_TEMPERATURE,
    VOCAB,
    RequestSpec,
    Workload,
)
from tandem.testing.scripted_model import scripted_next_token


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


def _starvation_workload(
    name: str, seed: int, long: tuple[int, int], every: float, num_short: int
) -> Workload:
    """A long request (`long` = prompt length, max_tokens) arrives first; then a steady
    stream of short ones, one every `every` steps, on a KV pool of one max-length sequence
    (16 blocks of 4) with four seats, so running requests keep outgrowing the pool and the
    scheduler keeps asking for victims. A victim rule that keeps choosing the long request
    (the longest remaining work, the largest KV holder) recomputes it again and again while
    the stream runs. It must finish within `finish_by`: twice the steps it needs alone
    (its prefill chunks plus one step per output) plus 16, well before the stream ends."""
    rng = random.Random(seed)
    prompt_len, max_tokens = long
    budget = 16
    alone = -(-prompt_len // budget) + max_tokens
    requests = [
        RequestSpec(
            f"{name}-long",
            tuple(rng.choice([2, 3, 5, 7, 11]) for _ in range(prompt_len)),
            max_tokens=max_tokens,
            ignore_eos=True,
            finish_by=2 * alone + 16,
        )
    ]
    requests += [
        RequestSpec(
            f"{name}-s{i}",
            tuple(rng.choice([2, 3, 5, 7, 11]) for _ in range(rng.randint(3, 6))),
            max_tokens=rng.randint(6, 14),
            ignore_eos=True,
            arrival=1 + int(i * every),
        )
        for i in range(num_short)
    ]
    return Workload(
        name,
        tuple(requests),
        _limits(
            num_kv_blocks=16,
            max_num_batched_tokens=budget,
            max_num_seqs=4,
            enable_prefix_caching=False,
        ),
        max_preemptions_per_request=PREEMPTION_BOUND,
    )


def _starvation_workloads() -> tuple[Workload, ...]:
    return (
        _starvation_workload("starve-decode", 17, (16, 40), 2.0, 100),
        _starvation_workload("starve-prefill", 18, (24, 32), 3.0, 70),
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
        "victim-starvation",
        "a request preempted again and again under a steady stream is preempted at most "
        "PREEMPTION_BOUND times and finishes within its bound",
        _starvation_workloads(),
    ),
    Check(
        "grammar-ready",
        "a request is not scheduled while it is not ready, and blocks no one",
        _grammar_ready_workloads(),
    ),
)

#: The check names, in run order.
CHECKS: tuple[str, ...] = tuple(c.name for c in CHECK_LIST)

_CHECKS_BY_NAME = {c.name: c for c in CHECK_LIST}
