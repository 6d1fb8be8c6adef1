"""One owner for drafts, one path in both scheduling modes (spec: async scheduling, drafts).

The worker's draft store owns the drafter's proposals and reports them in
`ModelRunnerOutput.draft_token_ids` under sync and async scheduling alike. The scheduler
records each proposal on its request (`Request.draft_token_ids`); under sync it schedules
it (`spec_token_ids`), under async it keeps its `-1` placeholders, which the worker fills
with the same proposal. A preempted request's proposal is gone on both sides.

A spy plugin stacked on the engine checks, after every step's `update_from_output`, what
the scheduler recorded, on a drafting workload with preemptions (scripted model, scripted
drafter with some wrong drafts, a small KV pool).
"""

from __future__ import annotations

from typing import Any, cast

import pytest

from tandem.core import hookimpl
from tandem.core.engine_core import EngineCore
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.request import RequestStatus
from tandem.core.scheduler_output import SchedulerOutput, drafts_to_verify
from tandem.plugins.reference_scheduler import ReferenceScheduler
from tandem.testing.engine import collect_outputs, make_request, scripted_config

VOCAB = 128
K = 3


class DraftSpy:
    """Checks the scheduler's record of each step's proposals (runs after it: trylast)."""

    def __init__(self, scheduler: ReferenceScheduler, async_scheduling: bool) -> None:
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling
        self.num_checked = 0
        self.num_preempted = 0

    @hookimpl(trylast=True)
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        proposals = model_runner_output.draft_token_ids
        assert proposals is not None  # a drafter is stacked: reported in both modes
        requests = self.scheduler.requests
        for req_id in scheduler_output.preempted_req_ids:
            if req_id in requests:
                self.num_preempted += 1
                assert requests[req_id].draft_token_ids == []
        for req_id, proposal in proposals.items():
            request = requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished by this result, or its result was stale
            assert len(proposal) == K
            assert request.draft_token_ids == proposal
            if self.async_scheduling:
                assert all(t == -1 for t in request.spec_token_ids)
            else:
                assert request.spec_token_ids == proposal
            self.num_checked += 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_scheduler_records_the_workers_proposal_and_preemption_drops_it(
    async_scheduling: bool,
) -> None:
    config = scripted_config(
        async_scheduling=async_scheduling,
        vocab_size=VOCAB,
        num_kv_blocks=20,  # 80 slots for 6 requests of up to 40 tokens: preemptions
        block_size=4,
        max_model_len=64,
        speculative={"method": "scripted", "num_speculative_tokens": K},
        plugins=[
            {"name": "reference-scheduler"},
            {"name": "default-sampler"},
            {"name": "scripted-drafter", "options": {"num_correct": 1}},
        ],
    )
    engine = EngineCore(config)
    scheduler = cast(ReferenceScheduler, engine.plugin_manager.plugins_with_role("scheduler")[0])
    spy = DraftSpy(scheduler, async_scheduling)
    engine.plugin_manager.register(spy)
    for i in range(6):
        prompt = [(7 * i + j) % (VOCAB - 2) + 2 for j in range(10 + i)]
        engine.add_request(make_request(f"r{i}", prompt, max_tokens=24, ignore_eos=True))
    outputs = collect_outputs(engine)
    engine.shutdown()
    assert all(len(tokens) == 24 for tokens, _ in outputs.values())
    assert spy.num_checked > 20 and spy.num_preempted > 0


@pytest.mark.parametrize(
    ("scheduled", "proposal", "verified"),
    [
        ([5, 6], [9, 9, 9], [5, 6]),  # real ids (sync): verified as scheduled
        ([-1, -1], [7, 8, 9], [7, 8]),  # placeholders: the proposal, cut
        ([-1, -1, -1], [7], [7, 0, 0]),  # placeholders: the proposal, padded with 0
        ([-1], [], [0]),
        ([], [1, 2], []),
    ],
)
def test_drafts_to_verify_is_the_one_padding_rule(
    scheduled: list[int], proposal: list[int], verified: list[int]
) -> None:
    assert drafts_to_verify(scheduled, proposal) == verified


def test_no_drafter_reports_no_proposals() -> None:
    engine = EngineCore(scripted_config(async_scheduling=False, vocab_size=VOCAB))
    seen: list[Any] = []

    class Spy:
        @hookimpl
        def update_from_output(
            self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
        ) -> None:
            seen.append(model_runner_output.draft_token_ids)

    engine.plugin_manager.register(Spy())
    engine.add_request(make_request("a", [3, 4, 5], max_tokens=3))
    collect_outputs(engine)
    engine.shutdown()
    assert seen and all(d is None for d in seen)
