"""The n-gram drafter in the engine on the scripted model: greedy outputs equal the engine
without speculation (sync and async), in the scenarios where draft bookkeeping can go
wrong, and the scheduler's draft rules (budget, max_model_len, KV for drafts, accounting).

The scripted model's next token is a hash of the history, so on a tiny vocabulary the
n-gram drafter's guesses are right by chance often enough that accepted runs of 2-4 tokens,
and rejections after them, both happen. Each test asserts that its scenario actually
occurred (from a `StepLog` on the engine's plugin manager), not only that outputs match.
Every engine checks the ledger and KV invariants after each step (`check_invariants`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from tandem.core import hookimpl
from tandem.core.engine_core import EngineCore
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.request import Request
from tandem.core.scheduler_output import SchedulerOutput
from tandem.plugins.reference_scheduler import ReferenceScheduler
from tandem.testing.engine import collect_outputs, make_request, make_scripted_engine

VOCAB = 5
EOS = 1
K = 3
SYNC_AND_ASYNC = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}


@dataclass
class StepLog:
    """What each step scheduled, and every result the scheduler trimmed at a stop."""

    scheduler: ReferenceScheduler
    #: per step: (num_scheduled_tokens, scheduled drafts, num_computed after scheduling)
    steps: list[tuple[dict[str, int], dict[str, int], dict[str, int]]] = field(default_factory=list)
    #: (request id, tokens the worker returned, tokens kept, finish status)
    trimmed: list[tuple[str, int, int, str]] = field(default_factory=list)
    _before: dict[str, tuple[Request, int, int]] = field(default_factory=dict)

    @hookimpl(trylast=True)
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        so = scheduler_output
        computed = {
            r: self.scheduler.requests[r].num_computed_tokens for r in so.num_scheduled_tokens
        }
        spec = {r: len(t) for r, t in so.scheduled_spec_decode_tokens.items()}
        self.steps.append((dict(so.num_scheduled_tokens), spec, computed))

    def before(self, mro: ModelRunnerOutput) -> None:
        self._before = {}
        for rid, i in mro.req_id_to_index.items():
            request = self.scheduler.requests.get(rid)
            if request is not None and mro.sampled_token_ids[i]:
                self._before[rid] = (
                    request,
                    request.num_output_tokens,
                    len(mro.sampled_token_ids[i]),
                )

    @hookimpl(trylast=True)
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        for rid, (request, num_before, returned) in self._before.items():
            kept = request.num_output_tokens - num_before
            if request.is_finished and kept < returned:
                self.trimmed.append((rid, returned, kept, request.status.name))


class _Before:
    def __init__(self, log: StepLog) -> None:
        self.log = log

    @hookimpl(tryfirst=True)
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        self.log.before(model_runner_output)


def scheduler_of(engine: EngineCore) -> ReferenceScheduler:
    return cast(ReferenceScheduler, engine.plugin_manager.plugins_with_role("scheduler")[0])


def engine_with_log(**overrides: Any) -> tuple[EngineCore, StepLog]:
    engine = make_scripted_engine(vocab_size=VOCAB, eos_token_id=EOS, **overrides)
    log = StepLog(scheduler_of(engine))
    engine.plugin_manager.register(log, name="step-log")
    engine.plugin_manager.register(_Before(log), name="step-log-before")
    return engine, log


def repetitive_prompt(seed: int, length: int) -> list[int]:
    """A prompt of a short repeated phrase (so the drafter has matches from the start)."""
    phrase = [2 + (seed + i * i) % (VOCAB - 2) for i in range(3 + seed % 3)]
    return (phrase * length)[:length]


def run(
    requests: list[tuple[str, list[int], dict[str, Any]]], spec: bool, **overrides: Any
) -> tuple[dict[str, tuple[list[int], str | None]], EngineCore, StepLog]:
    engine, log = engine_with_log(speculative=NGRAM if spec else None, **overrides)
    for rid, prompt, params in requests:
        engine.add_request(make_request(rid, prompt, **params))
    outputs = collect_outputs(engine)
    kv = scheduler_of(engine).kv_cache_manager
    assert kv.all_blocks_free(), f"KV leak: {kv.num_free_blocks} of {kv.num_blocks} free"
    assert not engine.has_work()
    return outputs, engine, log


def mixed_requests(n: int = 10) -> list[tuple[str, list[int], dict[str, Any]]]:
    return [
        (f"r{i}", repetitive_prompt(i, 6 + 5 * i), {"max_tokens": 5 + 7 * i, "ignore_eos": True})
        for i in range(n)
    ]


@pytest.mark.parametrize("async_scheduling", SYNC_AND_ASYNC)
def test_greedy_outputs_equal_no_speculation_and_max_tokens_cut_an_accepted_run(
    async_scheduling: bool,
) -> None:
    reqs = mixed_requests()
    want, _, _ = run(reqs, spec=False, async_scheduling=async_scheduling)
    got, engine, log = run(reqs, spec=True, async_scheduling=async_scheduling)
    assert got == want
    metrics = scheduler_of(engine).spec_metrics
    assert (
        metrics.num_accepted_tokens > 0 and metrics.num_draft_tokens > metrics.num_accepted_tokens
    )
    assert any(s == "FINISHED_LENGTH_CAPPED" and returned >= 2 for _, returned, _, s in log.trimmed)


@pytest.mark.parametrize("async_scheduling", SYNC_AND_ASYNC)
def test_stop_token_inside_an_accepted_run_is_trimmed(async_scheduling: bool) -> None:
    """Stop token 2 occurs in the prompts, so the drafter proposes it and it gets accepted
    in the middle of a run: the tokens after it are dropped, placeholders still resolve."""
    reqs = [
        (
            f"s{i}",
            repetitive_prompt(i, 12 + i % 7),
            {"max_tokens": 60, "stop_token_ids": [2], "ignore_eos": True},
        )
        for i in range(40)
    ]
    want, _, _ = run(reqs, spec=False, async_scheduling=async_scheduling)
    got, _, log = run(reqs, spec=True, async_scheduling=async_scheduling)
    assert got == want
    assert all(reason == "stop" and tokens[-1] == 2 for tokens, reason in got.values())
    assert any(s == "FINISHED_STOPPED" and returned >= 2 for _, returned, _, s in log.trimmed)


@pytest.mark.parametrize("async_scheduling", SYNC_AND_ASYNC)
def test_preemption_with_drafts_in_flight(async_scheduling: bool) -> None:
    reqs = mixed_requests(8)
    small = {"num_kv_blocks": 30, "max_model_len": 120, "async_scheduling": async_scheduling}
    want, _, _ = run(reqs, spec=False, **small)
    got, engine, log = run(reqs, spec=True, **small)
    assert got == want
    sched = scheduler_of(engine)
    assert sched.num_preemptions > 0
    assert sched.spec_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("async_scheduling", SYNC_AND_ASYNC)
def test_chunked_prefill_with_drafts_and_spec_tokens_in_the_budget(async_scheduling: bool) -> None:
    budget = 10
    reqs = mixed_requests(6)
    small = {"max_num_batched_tokens": budget, "async_scheduling": async_scheduling}
    want, _, _ = run(reqs, spec=False, **small)
    got, engine, log = run(reqs, spec=True, **small)
    assert got == want
    prompt_len = {rid: len(p) for rid, p, _ in reqs}
    chunked = False
    trimmed_to_budget = False
    for scheduled, spec, computed in log.steps:
        assert sum(scheduled.values()) <= budget  # drafts count in the budget
        for rid, n in scheduled.items():
            assert n >= 1 + spec.get(rid, 0)  # each draft scheduled has its slot
            chunked |= computed[rid] < prompt_len[rid]
        trimmed_to_budget |= (
            sum(scheduled.values()) == budget
            and 0 < min((spec.get(r, K) for r in scheduled), default=K) < K
        )
    assert chunked and trimmed_to_budget
    assert scheduler_of(engine).spec_metrics.num_accepted_tokens > 0


@pytest.mark.parametrize("async_scheduling", SYNC_AND_ASYNC)
def test_drafts_are_trimmed_to_max_model_len(async_scheduling: bool) -> None:
    max_len = 48
    reqs = [
        (f"m{i}", repetitive_prompt(i, 20 + 3 * i), {"max_tokens": 200, "ignore_eos": True})
        for i in range(4)
    ]
    settings = {"max_model_len": max_len, "async_scheduling": async_scheduling}
    want, _, _ = run(reqs, spec=False, **settings)
    got, _, log = run(reqs, spec=True, **settings)
    assert got == want
    assert all(len(p) + len(got[rid][0]) == max_len for rid, p, _ in reqs)
    near_end = False
    for scheduled, spec, computed in log.steps:
        for rid in scheduled:
            # `computed` is after scheduling: every input position stays below max_model_len.
            assert computed[rid] <= max_len - 1
            near_end |= computed[rid] == max_len - 1 and 0 < spec.get(rid, 0) < K
    assert near_end  # drafts were cut short by max_model_len, not just by the drafter


def test_per_request_acceptance_accounting_matches_the_metrics() -> None:
    """The metrics' totals equal the per-step sums of accepted drafts (returned - 1)."""
    engine, log = engine_with_log(speculative=NGRAM, async_scheduling=False)
    counted = {"draft": 0, "accepted": 0}

    class Count:
        @hookimpl(tryfirst=True)
        def update_from_output(
            self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
        ) -> None:
            for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
                i = model_runner_output.req_id_to_index[rid]
                counted["draft"] += len(drafts)
                counted["accepted"] += len(model_runner_output.sampled_token_ids[i]) - 1

    engine.plugin_manager.register(Count(), name="count")
    for rid, prompt, params in mixed_requests(5):
        engine.add_request(make_request(rid, prompt, **params))
    collect_outputs(engine)
    metrics = scheduler_of(engine).spec_metrics.as_dict()
    assert metrics["num_draft_tokens"] == counted["draft"] > 0
    assert metrics["num_accepted_tokens"] == counted["accepted"] > 0
    rates = cast(list[float], metrics["acceptance_rate_per_position"])
    assert len(rates) == K and rates[0] >= rates[1] >= rates[2]
    assert metrics["mean_acceptance_length"] == pytest.approx(
        1 + counted["accepted"] / cast(int, metrics["num_verify_steps"])
    )


def test_front_door_reports_spec_decode_metrics() -> None:
    from tandem import LLM, SamplingParams

    llm = LLM(
        model="scripted",
        vocab_size=VOCAB,
        eos_token_id=EOS,
        speculative_config=NGRAM,
        async_scheduling=False,
        max_model_len=256,
        block_size=4,
    )
    outs = llm.generate(
        [repetitive_prompt(i, 12) for i in range(4)],
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    )
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    metrics = llm.spec_decode_metrics()
    llm.shutdown()
    assert metrics is not None
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]
    assert metrics["mean_acceptance_length"] > 1.0
    assert len(metrics["acceptance_rate_per_position"]) == K
    plain = LLM(model="scripted", async_scheduling=False, max_model_len=256, block_size=4)
    assert plain.spec_decode_metrics() is None
    plain.shutdown()


@pytest.mark.parametrize("async_scheduling", SYNC_AND_ASYNC)
def test_disable_by_batch_size_skips_drafts_while_the_batch_is_large(
    async_scheduling: bool,
) -> None:
    """With `disable_by_batch_size: 3`, steps with more than 3 running requests schedule no
    drafts; once the batch has drained to 3 or fewer, drafts are verified again. Outputs
    stay those of the engine without speculation."""
    reqs = [
        (f"r{i}", repetitive_prompt(i, 12), {"max_tokens": 6 + 10 * i, "ignore_eos": True})
        for i in range(6)
    ]
    settings = {"async_scheduling": async_scheduling}
    want, _, _ = run(reqs, spec=False, **settings)
    engine, log = engine_with_log(speculative={**NGRAM, "disable_by_batch_size": 3}, **settings)
    for rid, prompt, params in reqs:
        engine.add_request(make_request(rid, prompt, **params))
    got = collect_outputs(engine)
    assert got == want
    running_before: list[int] = []
    small_batch_drafts = False
    for scheduled, spec, _ in log.steps:
        running_before.append(len(scheduled))
        if len(scheduled) > 3:
            # All six are admitted in the first step (which has no drafts to verify), so a
            # step scheduling more than 3 requests began with more than 3 running.
            assert not spec, (scheduled, spec)
        small_batch_drafts |= len(scheduled) <= 3 and bool(spec)
    assert small_batch_drafts
    assert max(running_before) == 6
    assert scheduler_of(engine).spec_metrics.num_accepted_tokens > 0
