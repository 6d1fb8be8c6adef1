"""Seeded sampling with n-gram drafts on the scripted model: a seeded request's tokens do
not depend on its batch or on sync/async scheduling, and verification really samples
(some drafts accepted, some rejected)."""

from __future__ import annotations

from typing import Any, cast

from tandem.plugins.reference_scheduler import ReferenceScheduler
from tandem.testing.engine import collect_outputs, make_request, make_scripted_engine

VOCAB = 5
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
# Temperature 3 flattens the scripted logits (peak 8 over a ripple in [0, 2)): the scripted
# token has probability ~0.7, so acceptance and rejection both happen.
SEEDED = {"temperature": 3.0, "seed": 1234, "max_tokens": 40, "ignore_eos": True}


def prompt(i: int) -> list[int]:
    return ([2, 3, 4, 2 + i % 3] * 6)[: 10 + i]


def run(requests: list[tuple[str, list[int], dict[str, Any]]], async_scheduling: bool) -> Any:
    engine = make_scripted_engine(
        vocab_size=VOCAB, eos_token_id=1, speculative=SPEC, async_scheduling=async_scheduling
    )
    for rid, p, params in requests:
        engine.add_request(make_request(rid, p, **params))
    out = collect_outputs(engine)
    scheduler = cast(ReferenceScheduler, engine.plugin_manager.plugins_with_role("scheduler")[0])
    return out, scheduler.spec_metrics


def test_seeded_request_gives_the_same_tokens_alone_in_a_batch_sync_and_async() -> None:
    alone, metrics = run([("s", prompt(0), SEEDED)], async_scheduling=False)
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
    others = [
        (f"o{i}", prompt(i), {"temperature": 1.0, "max_tokens": 30 + i, "ignore_eos": True})
        for i in range(1, 6)
    ]
    others.append(("g", prompt(7), {"max_tokens": 25, "ignore_eos": True}))  # greedy
    others.append(("t", prompt(8), {**SEEDED, "seed": 99}))
    for async_scheduling in (False, True):
        batched, _ = run([*others[:3], ("s", prompt(0), SEEDED), *others[3:]], async_scheduling)
        assert batched["s"] == alone["s"]
    solo_async, _ = run([("s", prompt(0), SEEDED)], async_scheduling=True)
    assert solo_async["s"] == alone["s"]


def test_a_different_seed_gives_different_tokens() -> None:
    a, _ = run([("s", prompt(0), SEEDED)], async_scheduling=False)
    b, _ = run([("s", prompt(0), {**SEEDED, "seed": 4321})], async_scheduling=False)
    assert a["s"][0] != b["s"][0]
