"""The worked examples of the scheduler specification (reference/002), one per test.

Most tests drive `ReferenceScheduler` directly (schedule -> update_after_schedule ->
update_from_output with fabricated sampled tokens); the ledger table runs the whole engine
on the scripted model.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.outputs import EngineCoreOutput
from tandem.core.plugin_manager import TandemPluginManager
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

FAKE_TOKEN = 7  # any id that is not the EOS (1)


# Driving the scheduler by hand --------------------------------------------------------
def make_scheduler(**overrides: Any) -> ReferenceScheduler:
    return ReferenceScheduler(scripted_config(**overrides), ReferenceScheduler.Options())


def fake_runner_output(
    sched: ReferenceScheduler,
    so: SchedulerOutput,
    sampled: dict[str, list[int]] | None = None,
) -> ModelRunnerOutput:
    """One sampled token per request that samples this step (none for a prefill chunk);
    `sampled` overrides a request's row."""
    sampled = sampled or {}
    req_ids = list(so.num_scheduled_tokens)
    rows = []
    for rid in req_ids:
        if rid in sampled:
            rows.append(list(sampled[rid]))
        elif sched.requests[rid].is_prefill_chunk:
            rows.append([])
        else:
            rows.append([FAKE_TOKEN])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=rows,
    )


def finish(
    sched: ReferenceScheduler, so: SchedulerOutput, sampled: dict[str, list[int]] | None = None
) -> list[EngineCoreOutput]:
    return sched.update_from_output(so, fake_runner_output(sched, so, sampled))


def run_step(
    sched: ReferenceScheduler, sampled: dict[str, list[int]] | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = sched.schedule()
    sched.update_after_schedule(so)
    return so, finish(sched, so, sampled)


def distinct_prompt(rid: str, length: int) -> list[int]:
    """A prompt of its own per request id (no accidental prefix-cache hits)."""
    seed = zlib.crc32(rid.encode())
    return [2 + (seed + 37 * i + i * i) % 120 for i in range(length)]


def add(sched: ReferenceScheduler, rid: str, prompt_len: int, **params: Any) -> Request:
    params.setdefault("max_tokens", 16)
    request = make_request(rid, distinct_prompt(rid, prompt_len), **params)
    sched.add_request(request)
    return request


def ledger(request: Request) -> tuple[int, int, int]:
    return (
        request.num_tokens,
        request.num_computed_tokens,
        request.num_tokens - request.num_computed_tokens,
    )


# 1. The A B C -> D E F G ledger table --------------------------------------------------
def test_ledger_table_prompt_prefilled_in_one_step_then_one_token_per_decode() -> None:
    engine = make_scripted_engine()
    scheduled: list[dict[str, int]] = []
    execute_model = engine.executor.execute_model

    def spy(so: SchedulerOutput):  # noqa: ANN202
        scheduled.append(dict(so.num_scheduled_tokens))
        return execute_model(so)

    engine.executor.execute_model = spy  # type: ignore[method-assign]

    prompt = [11, 12, 13]  # A B C
    request = make_request("abc", prompt, max_tokens=4, ignore_eos=True)
    engine.add_request(request)
    assert ledger(request) == (3, 0, 3)  # just submitted: the whole prompt is owed

    expected_rows = [(4, 3, 1), (5, 4, 1), (6, 5, 1)]
    tokens: list[int] = []
    for row in expected_rows:
        outputs, executed = engine.step()
        assert executed
        tokens += [t for o in outputs for t in o.new_token_ids]
        assert ledger(request) == row
    outputs, _ = engine.step()  # G: the fourth output finishes the request
    tokens += [t for o in outputs for t in o.new_token_ids]
    assert [o.finish_reason for o in outputs] == ["length"]

    # The prompt in one step, then exactly one token per decode step.
    assert scheduled == [{"abc": 3}, {"abc": 1}, {"abc": 1}, {"abc": 1}]
    expected, _ = expected_scripted_output(
        prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), 128, 1, 256
    )
    assert tokens == expected  # D E F G
    assert not engine.has_work()


# 2. 200 decodes next to a 20000-token prompt ---------------------------------------------
def test_long_prompt_chunked_7992_7992_4016_next_to_200_decodes() -> None:
    sched = make_scheduler(
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        max_model_len=20100,
        block_size=16,
        num_kv_blocks=1600,
    )
    shorts = [add(sched, f"s{i}", 4, max_tokens=64) for i in range(200)]
    so, _ = run_step(sched)  # the 200 short prompts prefill together
    assert so.num_scheduled_tokens == {r.request_id: 4 for r in shorts}
    assert all(r.status == RequestStatus.RUNNING and r.num_tokens == 5 for r in shorts)

    long = add(sched, "long", 20000, max_tokens=64)
    assert (long.num_tokens, long.num_computed_tokens) == (20000, 0)

    expected_chunks = [7992, 7992, 4016]
    expected_computed = [7992, 15984, 20000]
    expected_prefill_chunk = [True, True, False]
    expected_num_tokens_after = [20000, 20000, 20001]
    for chunk, computed, is_chunk, num_tokens in zip(
        expected_chunks,
        expected_computed,
        expected_prefill_chunk,
        expected_num_tokens_after,
        strict=True,
    ):
        so = sched.schedule()
        # Every decode is served first, one token each; the long prompt gets the rest.
        assert so.num_scheduled_tokens == {
            **{r.request_id: 1 for r in shorts},
            "long": chunk,
        }
        assert so.total_num_scheduled_tokens == 200 + chunk <= 8192
        sched.update_after_schedule(so)
        assert long.num_computed_tokens == computed
        assert long.is_prefill_chunk is is_chunk
        assert long.num_tokens == 20000  # no output can exist before the prompt is done
        finish(sched, so)
        assert long.num_tokens == num_tokens
        assert long.num_tokens - long.num_computed_tokens == num_tokens - computed
    assert long.output_token_ids == [FAKE_TOKEN]
    assert all(r.num_output_tokens == 4 for r in shorts)


# 3. The placeholder example: 5 + 1 - 6 = 0 ---------------------------------------------
def test_placeholder_in_flight_means_nothing_to_schedule() -> None:
    sched = make_scheduler()
    request = add(sched, "r", 3, max_tokens=16)
    run_step(sched)  # prefill A B C, sample D
    run_step(sched)  # decode D, sample E
    assert request.status == RequestStatus.RUNNING
    assert (request.num_prompt_tokens, request.num_output_tokens) == (3, 2)
    # Async scheduling has reserved one more output slot and scheduled its position.
    request.num_output_placeholders = 1
    request.num_computed_tokens = 6
    work = (
        request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens
    )
    assert (request.num_tokens, work) == (5, 0)

    so = sched.schedule()
    assert "r" not in so.num_scheduled_tokens
    assert so.scheduled_cached_reqs == [] and so.scheduled_new_reqs == []
    assert so.total_num_scheduled_tokens == 0
    assert request.num_computed_tokens == 6
    assert request.status == RequestStatus.RUNNING
    assert so.preempted_req_ids == set()


def test_placeholder_ledger_reached_through_async_layer_owes_one_token_per_step() -> None:
    """Through the real stack (scheduler + async layer): with a step in flight the
    request owes exactly one token (the in-flight placeholder's position), never more."""
    manager = TandemPluginManager(scripted_config(async_scheduling=True))
    assert list(manager.plugin_names())[:2] == ["reference-scheduler", "async-scheduler"]
    sched = manager.plugins_with_role("scheduler")[0]
    request = make_request("r", [11, 12, 13], max_tokens=16)
    manager.hook.add_request(request=request)

    def schedule() -> SchedulerOutput:
        so = manager.hook.schedule()
        manager.hook.update_after_schedule(scheduler_output=so)
        return so

    def complete(so: SchedulerOutput) -> None:
        manager.hook.update_from_output(
            scheduler_output=so, model_runner_output=fake_runner_output(sched, so)
        )

    s1 = schedule()
    assert s1.num_scheduled_tokens == {"r": 3}
    assert (request.num_tokens, request.num_output_placeholders) == (3, 1)
    assert request.num_computed_tokens == 3
    s2 = schedule()  # planned while s1 is in flight: the placeholder's position
    assert s2.num_scheduled_tokens == {"r": 1}
    assert (request.num_tokens, request.num_output_placeholders) == (3, 2)
    assert request.num_computed_tokens == 4
    complete(s1)
    assert (request.num_tokens, request.num_output_placeholders) == (4, 1)
    s3 = schedule()
    assert s3.num_scheduled_tokens == {"r": 1}
    complete(s2)
    complete(s3)
    assert (request.num_tokens, request.num_computed_tokens) == (6, 5)
    assert request.num_output_placeholders == 0


# 4. The max_model_len clamp ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("room", "expected_new", "expected_drafts"),
    [(5, 4, 3), (4, 3, 2), (3, 2, 1), (2, 1, 0)],
)
def test_max_model_len_clamps_spec_decode_tokens(
    room: int, expected_new: int, expected_drafts: int
) -> None:
    """A decode with drafts [x, y, z] wants 1 + 3 tokens, but the positions computed must
    stay below max_model_len - 1 (the last position samples): num_new_tokens =
    min(4, max_model_len - num_computed_tokens - 1), and only that many drafts are sent."""
    max_model_len = 24
    prompt_len = max_model_len - room
    sched = make_scheduler(max_model_len=max_model_len)
    request = add(sched, "r", prompt_len, max_tokens=100)
    run_step(sched)  # prefill, sample one token
    assert (request.num_tokens, request.num_computed_tokens) == (prompt_len + 1, prompt_len)
    request.spec_token_ids = [21, 22, 23]

    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": expected_new}
    assert expected_new == min(1 + 3, max_model_len - request.num_computed_tokens - 1)
    if expected_drafts:
        assert so.scheduled_spec_decode_tokens == {"r": [21, 22, 23][:expected_drafts]}
    else:
        assert "r" not in so.scheduled_spec_decode_tokens
    sched.update_after_schedule(so)
    assert request.num_computed_tokens == prompt_len + expected_new
    if expected_new < 4:
        assert request.num_computed_tokens == max_model_len - 1

    # Every draft accepted, plus the bonus token: the request ends at max_model_len.
    accepted = [21, 22, 23][:expected_drafts] + [30]
    outputs = finish(sched, so, {"r": accepted})
    assert len(outputs) == 1
    out = outputs[0]
    if prompt_len + 1 + len(accepted) >= max_model_len:
        assert out.finish_reason == "length"
        assert request.num_tokens == max_model_len
        assert out.new_token_ids == accepted
    assert request.num_tokens <= max_model_len


def test_rejected_drafts_roll_back_so_a_decode_owes_one_token() -> None:
    sched = make_scheduler()
    request = add(sched, "r", 5, max_tokens=100)
    run_step(sched)
    assert ledger(request) == (6, 5, 1)
    request.spec_token_ids = [21, 22, 23]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 4}
    assert so.scheduled_spec_decode_tokens == {"r": [21, 22, 23]}
    sched.update_after_schedule(so)
    assert request.num_computed_tokens == 9
    # 21 accepted, 22 rejected: the target's correction 40 is the second token.
    outputs = finish(sched, so, {"r": [21, 40]})
    assert outputs[0].new_token_ids == [21, 40]
    assert ledger(request) == (8, 7, 1)


def test_drafts_dropped_when_the_step_samples_the_last_output_token() -> None:
    sched = make_scheduler()
    request = add(sched, "r", 5, max_tokens=2)
    run_step(sched)
    request.spec_token_ids = [21, 22, 23]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 1}
    assert so.scheduled_spec_decode_tokens == {}
    sched.update_after_schedule(so)
    outputs = finish(sched, so)
    assert outputs[0].finish_reason == "length"
    assert request.num_output_tokens == 2


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("prompt_len", [1, 20, 30, 31])
def test_request_never_exceeds_max_model_len(async_scheduling: bool, prompt_len: int) -> None:
    max_model_len = 32
    engine = make_scripted_engine(max_model_len=max_model_len, async_scheduling=async_scheduling)
    prompt = [(3 * i + 5) % 128 for i in range(prompt_len)]
    engine.add_request(make_request("r", prompt, max_tokens=1000, ignore_eos=True))
    result = collect_outputs(engine)
    tokens, reason = result["r"]
    assert reason == "length"
    assert prompt_len + len(tokens) == max_model_len
    expected = expected_scripted_output(
        prompt,
        SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True),
        128,
        1,
        max_model_len,
    )
    assert (tokens, reason) == expected


# 5. long_prefill_token_threshold -------------------------------------------------------
def test_long_prefill_threshold_chunks_with_budget_left() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    request = add(sched, "long", 30)
    chunks = []
    prefill_flags = []
    while request.num_output_tokens == 0:
        so = sched.schedule()
        sched.update_after_schedule(so)
        chunks.append(so.num_scheduled_tokens["long"])
        prefill_flags.append(request.is_prefill_chunk)
        finish(sched, so)
    assert chunks == [8, 8, 8, 6]  # budget (64) would have allowed the whole prompt
    assert prefill_flags == [True, True, True, False]
    so, _ = run_step(sched)
    assert so.num_scheduled_tokens == {"long": 1}  # decodes are unaffected


def test_long_prefill_threshold_output_matches_unchunked() -> None:
    prompt = [(7 * i + 3) % 128 for i in range(40)]
    params = {"max_tokens": 12, "ignore_eos": True}
    results = []
    for threshold in (0, 5):
        engine = make_scripted_engine(long_prefill_token_threshold=threshold)
        engine.add_request(make_request("r", prompt, **params))
        results.append(collect_outputs(engine)["r"])
    expected = expected_scripted_output(
        prompt, SamplingParams(temperature=0, **params), 128, 1, 256
    )
    assert results == [expected, expected]


# 6. max_num_seqs, max_num_batched_tokens, RUNNING before WAITING -----------------------
def test_max_num_seqs_caps_running() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=256)
    reqs = [add(sched, f"r{i}", 4) for i in range(4)]
    for _ in range(3):
        so, _ = run_step(sched)
        assert len(sched.running) == 2
        assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert [r.status for r in reqs] == [RequestStatus.RUNNING] * 2 + [RequestStatus.WAITING] * 2
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]


def test_max_num_batched_tokens_caps_total_scheduled() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    for i in range(3):
        add(sched, f"r{i}", 6)
    plans = []
    for _ in range(6):
        so, _ = run_step(sched)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= 10
        plans.append(so.num_scheduled_tokens)
    # r0's prompt and a 4-token chunk of r1; then r1's last 2 next to r0's decode and r2.
    assert plans[0] == {"r0": 6, "r1": 4}
    assert plans[1] == {"r0": 1, "r1": 2, "r2": 6}
    assert plans[2:] == [{"r0": 1, "r1": 1, "r2": 1}] * 4


def test_running_requests_are_served_before_waiting() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    add(sched, "old", 8)
    so, _ = run_step(sched)
    assert so.num_scheduled_tokens == {"old": 8}
    add(sched, "new", 8)
    so, _ = run_step(sched)
    # The running decode takes its token first; the waiting prompt gets what is left.
    assert list(so.num_scheduled_tokens.items()) == [("old", 1), ("new", 7)]
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["old"]
    assert [n.req_id for n in so.scheduled_new_reqs] == ["new"]


def test_running_prefill_chunk_is_served_before_waiting() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    add(sched, "big", 20)
    add(sched, "small", 2)
    for expected in ({"big": 8}, {"big": 8}, {"big": 4, "small": 2}):
        so, _ = run_step(sched)
        assert so.num_scheduled_tokens == expected


# 7. Skip and continue ---------------------------------------------------------------------
def test_running_request_with_nothing_owed_does_not_block_later_ones() -> None:
    sched = make_scheduler()
    first = add(sched, "first", 3)
    second = add(sched, "second", 3)
    run_step(sched)
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["first", "second"]
    # first: 5 known + 1 placeholder - 6 scheduled = 0 owed.
    first.num_output_placeholders = 1
    first.num_computed_tokens = 6
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"second": 1}
    assert first.status == RequestStatus.RUNNING
    assert second.status == RequestStatus.RUNNING


def test_async_no_extra_step_request_is_skipped_and_later_ones_scheduled() -> None:
    """Under async scheduling a request whose in-flight step already reaches max_tokens is
    not scheduled again; the request behind it in RUNNING still is."""
    manager = TandemPluginManager(scripted_config(async_scheduling=True))
    sched = manager.plugins_with_role("scheduler")[0]
    short = make_request("short", [11, 12, 13], max_tokens=2)
    other = make_request("other", [21, 22, 23], max_tokens=10)
    manager.hook.add_request(request=short)
    manager.hook.add_request(request=other)

    def schedule() -> SchedulerOutput:
        so = manager.hook.schedule()
        manager.hook.update_after_schedule(scheduler_output=so)
        return so

    def complete(so: SchedulerOutput) -> list[EngineCoreOutput]:
        results = manager.hook.update_from_output(
            scheduler_output=so, model_runner_output=fake_runner_output(sched, so)
        )
        return [o for r in results if r is not None for o in r]

    s1 = schedule()
    assert s1.num_scheduled_tokens == {"short": 3, "other": 3}
    s2 = schedule()
    assert s2.num_scheduled_tokens == {"short": 1, "other": 1}
    complete(s1)
    s3 = schedule()  # short's two outputs are both in flight or back: no third step
    assert s3.num_scheduled_tokens == {"other": 1}
    assert [r.request_id for r in sched.running] == ["short", "other"]
    outs = complete(s2)
    assert {o.request_id: o.finish_reason for o in outs} == {"short": "length", "other": None}
    assert short.num_output_tokens == 2
    complete(s3)


def test_request_at_max_model_len_is_skipped_and_later_ones_scheduled() -> None:
    """Under async scheduling a request whose in-flight step already takes its last position
    (max_model_len clamp gives 0) is skipped; the request behind it is still scheduled."""
    manager = TandemPluginManager(scripted_config(async_scheduling=True, max_model_len=32))
    sched = manager.plugins_with_role("scheduler")[0]
    edge = make_request("edge", [(5 * i) % 128 for i in range(30)], max_tokens=100)
    other = make_request("other", [21, 22, 23], max_tokens=10)
    manager.hook.add_request(request=edge)
    manager.hook.add_request(request=other)

    def schedule() -> SchedulerOutput:
        so = manager.hook.schedule()
        manager.hook.update_after_schedule(scheduler_output=so)
        return so

    def complete(so: SchedulerOutput) -> list[EngineCoreOutput]:
        results = manager.hook.update_from_output(
            scheduler_output=so, model_runner_output=fake_runner_output(sched, so)
        )
        return [o for r in results if r is not None for o in r]

    s1 = schedule()
    assert s1.num_scheduled_tokens == {"edge": 30, "other": 3}
    s2 = schedule()
    assert s2.num_scheduled_tokens == {"edge": 1, "other": 1}
    complete(s1)
    assert edge.num_computed_tokens == 31  # position 31 is the last one
    s3 = schedule()
    assert s3.num_scheduled_tokens == {"other": 1}
    outs = complete(s2)
    assert {o.request_id: o.finish_reason for o in outs} == {"edge": "length", "other": None}
    assert edge.num_tokens == 32
    complete(s3)
