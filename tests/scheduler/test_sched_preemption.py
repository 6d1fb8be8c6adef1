"""Preemption by recompute: who the victim is, what happens to it, and that resuming gives
the same output as never being preempted.

Victim-selection tests drive `ReferenceScheduler` directly on tiny KV pools (block_size 4,
prefix caching off so block counts are exact) with fabricated sampled tokens.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest

from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.outputs import EngineCoreOutput
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler_output import SchedulerOutput
from tandem.plugins.reference_scheduler import ReferenceScheduler
from tandem.schema.sampling_params import SamplingParams
from tandem.testing import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    make_scripted_engine,
    scripted_config,
)

FAKE_TOKEN = 7


def make_scheduler(**overrides: Any) -> ReferenceScheduler:
    overrides.setdefault("enable_prefix_caching", False)
    return ReferenceScheduler(scripted_config(**overrides), ReferenceScheduler.Options())


def distinct_prompt(rid: str, length: int) -> list[int]:
    seed = zlib.crc32(rid.encode())
    return [2 + (seed + 37 * i + i * i) % 120 for i in range(length)]


def add(sched: ReferenceScheduler, rid: str, prompt_len: int, **kwargs: Any) -> Request:
    kwargs.setdefault("max_tokens", 16)
    request = make_request(rid, distinct_prompt(rid, prompt_len), **kwargs)
    sched.add_request(request)
    return request


def finish(sched: ReferenceScheduler, so: SchedulerOutput) -> list[EngineCoreOutput]:
    req_ids = list(so.num_scheduled_tokens)
    rows = [[] if sched.requests[rid].is_prefill_chunk else [FAKE_TOKEN] for rid in req_ids]
    return sched.update_from_output(
        so,
        ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=rows,
        ),
    )


def run_step(sched: ReferenceScheduler) -> SchedulerOutput:
    so = sched.schedule()
    sched.update_after_schedule(so)
    finish(sched, so)
    return so


def ids(requests: Any) -> list[str]:
    return [r.request_id for r in requests]


# 1. FCFS ----------------------------------------------------------------------------------
def test_fcfs_preempts_most_recently_admitted_and_requeues_it_first() -> None:
    sched = make_scheduler(num_kv_blocks=5, max_model_len=16)
    kv = sched.kv_cache_manager
    a = add(sched, "A", 4)
    b = add(sched, "B", 4)
    c = add(sched, "C", 6)
    so = run_step(sched)  # A: 1 block, B: 1 block, C: 2 blocks
    assert so.num_scheduled_tokens == {"A": 4, "B": 4, "C": 6}
    assert kv.num_free_blocks == 1
    d = add(sched, "D", 2)  # would fit: 2 tokens, 1 block, plenty of budget

    # A takes the last free block; B needs one too: C (running[-1]) is the victim.
    so = sched.schedule()
    assert so.preempted_req_ids == {"C"}
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert ids(sched.running) == ["A", "B"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert kv.get_block_ids("C") == []
    assert c.num_tokens == 7  # its confirmed output is kept for the recompute
    assert ids(sched.waiting) == ["C", "D"]  # the victim goes first
    assert so.scheduled_new_reqs == []  # no admission in a step that preempted
    assert d.status == RequestStatus.WAITING
    assert kv.num_free_blocks == 1  # C's two blocks came back, B took one
    assert sched.num_preemptions == 1 and c.num_preemptions == 1
    assert a.status == b.status == RequestStatus.RUNNING
    sched.update_after_schedule(so)
    finish(sched, so)

    # Run to completion: C is resumed (as a new request, with its output) before D.
    admitted = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so = run_step(sched)
        admitted += so.scheduled_new_reqs
    assert not sched.has_unfinished_requests()
    c_and_d = [n for n in admitted if n.req_id in ("C", "D")]
    assert c_and_d[0].req_id == "C"  # the preempted request is admitted before D
    assert "D" in [n.req_id for n in c_and_d]
    first_resume = c_and_d[0]
    assert first_resume.token_ids == distinct_prompt("C", 6) + [FAKE_TOKEN]
    assert first_resume.num_prompt_tokens == 6
    assert first_resume.num_computed_tokens == 0
    assert kv.all_blocks_free()


def test_no_admission_in_a_step_that_preempted_even_when_the_head_would_fit() -> None:
    """With long_prefill_token_threshold 4 the victim's resume chunk needs a single block,
    and one is free after the preemption: still nothing is admitted in that step."""
    sched = make_scheduler(num_kv_blocks=3, max_model_len=12, long_prefill_token_threshold=4)
    kv = sched.kv_cache_manager
    add(sched, "A", 3)
    c = add(sched, "C", 5)
    assert run_step(sched).num_scheduled_tokens == {"A": 3, "C": 4}
    assert run_step(sched).num_scheduled_tokens == {"A": 1, "C": 1}  # C takes a 2nd block
    add(sched, "D", 2)
    assert kv.num_free_blocks == 0
    so = sched.schedule()  # A's position 4 needs a block: C (2 blocks) is the victim
    assert so.preempted_req_ids == {"C"}
    assert so.num_scheduled_tokens == {"A": 1}
    assert kv.num_free_blocks == 1  # enough for C's 4-token resume chunk, or for D
    assert so.scheduled_new_reqs == []
    assert ids(sched.waiting) == ["C", "D"]
    sched.update_after_schedule(so)
    finish(sched, so)
    so = run_step(sched)  # the next step admits C first
    assert so.num_scheduled_tokens == {"A": 1, "C": 4}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["C"]
    assert c.status == RequestStatus.RUNNING


# 2. Priority --------------------------------------------------------------------------------
def test_priority_victim_is_largest_priority_even_if_earlier_in_running() -> None:
    sched = make_scheduler(num_kv_blocks=3, max_model_len=12, scheduling_policy="priority")
    kv = sched.kv_cache_manager
    x = add(sched, "X", 2, priority=5, arrival_time=0.0)
    run_step(sched)  # X alone: 1 block
    y = add(sched, "Y", 4, priority=0, arrival_time=1.0)
    z = add(sched, "Z", 6, priority=0, arrival_time=2.0)
    sched.max_num_batched_tokens = 7
    so = run_step(sched)
    assert so.num_scheduled_tokens == {"X": 1, "Y": 4, "Z": 2}
    assert ids(sched.running) == ["X", "Y", "Z"]
    assert kv.num_free_blocks == 0

    # Budget 3: X gets its decode token first; then Y needs a block. The victim is X (the
    # largest (priority, arrival)), not Z (running[-1]) and not Y. X's token is taken back
    # and the budget restored: Z gets 2 tokens, which it could not with X's token spent.
    sched.max_num_batched_tokens = 3
    so = sched.schedule()
    assert so.preempted_req_ids == {"X"}
    assert so.num_scheduled_tokens == {"Y": 1, "Z": 2}
    assert so.total_num_scheduled_tokens == 3
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["Y", "Z"]
    assert x.status == RequestStatus.PREEMPTED and x.num_computed_tokens == 0
    assert kv.get_block_ids("X") == []
    assert ids(sched.running) == ["Y", "Z"]
    assert ids(sched.waiting) == ["X"]
    sched.update_after_schedule(so)
    assert x.num_computed_tokens == 0 and x.num_in_flight_tokens == 0
    assert (y.num_computed_tokens, z.num_computed_tokens) == (5, 4)
    finish(sched, so)
    assert x.num_tokens == 4  # confirmed outputs survive


def test_priority_ties_broken_by_latest_arrival_not_running_order() -> None:
    sched = make_scheduler(num_kv_blocks=2, max_model_len=8, scheduling_policy="priority")
    late = add(sched, "late", 2, arrival_time=10.0)
    run_step(sched)
    early = add(sched, "early", 4, arrival_time=5.0)
    run_step(sched)
    assert ids(sched.running) == ["late", "early"]
    # late decodes without a new block; early needs one: the victim is `late` (the later
    # arrival), although `early` is running[-1].
    so = sched.schedule()
    assert so.preempted_req_ids == {"late"}
    assert so.num_scheduled_tokens == {"early": 1}
    assert late.status == RequestStatus.PREEMPTED
    assert early.status == RequestStatus.RUNNING


# 3. Self-preemption -------------------------------------------------------------------------
def test_fcfs_request_preempts_itself_when_it_is_the_last() -> None:
    sched = make_scheduler(num_kv_blocks=2, max_model_len=8)
    kv = sched.kv_cache_manager
    add(sched, "A", 1)
    b = add(sched, "B", 4)
    run_step(sched)
    so = sched.schedule()  # A fits in its block; B needs a second block: none is free
    assert so.preempted_req_ids == {"B"}
    assert so.num_scheduled_tokens == {"A": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert kv.get_block_ids("B") == [] and kv.num_free_blocks == 1
    assert ids(sched.running) == ["A"] and ids(sched.waiting) == ["B"]
    assert so.scheduled_new_reqs == []


def test_priority_self_preemption_stops_scheduling_running() -> None:
    sched = make_scheduler(num_kv_blocks=3, max_model_len=12, scheduling_policy="priority")
    add(sched, "A", 1, priority=0, arrival_time=0.0)
    run_step(sched)
    m = add(sched, "M", 3, priority=9, arrival_time=1.0)
    run_step(sched)
    add(sched, "C", 2, priority=0, arrival_time=2.0)
    run_step(sched)
    assert ids(sched.running) == ["A", "M", "C"]
    assert sched.kv_cache_manager.num_free_blocks == 0
    # A fits; M needs a block and is itself the lowest-priority request: it preempts
    # itself, and nothing after it in RUNNING is scheduled this step (C would fit).
    so = sched.schedule()
    assert so.preempted_req_ids == {"M"}
    assert so.num_scheduled_tokens == {"A": 1}
    assert m.status == RequestStatus.PREEMPTED
    assert ids(sched.running) == ["A", "C"]
    assert ids(sched.waiting) == ["M"]


# 4. Resume gives identical output ---------------------------------------------------------
def workload() -> list[tuple[str, list[int], dict[str, Any]]]:
    rng = random.Random(1234)
    reqs = []
    for i in range(8):
        prompt = [rng.randrange(2, 128) for _ in range(rng.randint(3, 14))]
        reqs.append((f"r{i}", prompt, {"max_tokens": rng.randint(8, 18)}))
    return reqs


def run_workload(**overrides: Any) -> tuple[dict[str, tuple[list[int], str | None]], int]:
    engine = make_scripted_engine(max_model_len=32, block_size=4, **overrides)
    for rid, prompt, params in workload():
        engine.add_request(make_request(rid, prompt, **params))
    result = collect_outputs(engine)
    sched = engine.plugin_manager.plugins_with_role("scheduler")[0]
    assert sched.kv_cache_manager.all_blocks_free()
    return result, sched.num_preemptions


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["nocache", "cache"])
def test_preempted_requests_resume_with_identical_output(
    async_scheduling: bool, prefix_caching: bool
) -> None:
    common = {"async_scheduling": async_scheduling, "enable_prefix_caching": prefix_caching}
    big, big_preemptions = run_workload(num_kv_blocks=256, **common)
    small, small_preemptions = run_workload(num_kv_blocks=10, **common)
    assert big_preemptions == 0
    assert small_preemptions > 0
    expected = {
        rid: expected_scripted_output(prompt, SamplingParams(temperature=0, **params), 128, 1, 32)
        for rid, prompt, params in workload()
    }
    assert big == expected
    assert small == expected


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_seeded_requests_resume_with_identical_output(async_scheduling: bool) -> None:
    """Seeded sampling draws from (seed, output index): a recompute after preemption must
    not change what a seeded request samples."""

    def run(num_kv_blocks: int) -> tuple[dict[str, tuple[list[int], str | None]], int]:
        engine = make_scripted_engine(
            max_model_len=32,
            num_kv_blocks=num_kv_blocks,
            async_scheduling=async_scheduling,
        )
        rng = random.Random(7)
        for i in range(8):
            prompt = [rng.randrange(2, 128) for _ in range(rng.randint(3, 14))]
            engine.add_request(
                make_request(
                    f"r{i}", prompt, max_tokens=rng.randint(8, 18), temperature=1.0, seed=i
                )
            )
        result = collect_outputs(engine)
        return result, engine.plugin_manager.plugins_with_role("scheduler")[0].num_preemptions

    big, big_preemptions = run(256)
    small, small_preemptions = run(8)
    assert (big_preemptions, small_preemptions > 0) == (0, True)
    assert small == big
