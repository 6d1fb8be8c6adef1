"""The deferred-free fence under async scheduling, with a KV write that lands late.

`LateWriteExecutor` runs the worker in process but makes each step's KV write land when
the engine *collects* the step (calls `result()` on its sample future), i.e. after the
engine may already have scheduled and executed the next step, as on a real device where
step t's kernels may still be writing while step t+1 is planned. A block freed while step
t is in flight must therefore not reach another request before step t is processed: that
is the fence. With it, a request admitted right after an abort gets exact outputs; with
the fence switched off on the live KV manager, the late write corrupts the new owner's KV
and its output changes (the negative control proving the scenario exercises the fence).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from budget import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.core.engine_core import EngineCore
from tandem.core.executor import Executor, completed
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.flat_batch import FlatBatch
from tandem.core.worker.worker import Worker
from tandem.kv import KVCacheManager
from tandem.testing.engine import (
    expected_scripted_output,
    make_request,
    scripted_config,
)
from tandem.testing.stubs import CollectFuture as LateFuture

VOCAB = 128
EOS = 1


@dataclass
class StepRecord:
    """What the executor saw of one step when it was executed (after the scheduler planned
    it and before any later step was collected)."""

    step_id: int
    num_scheduled_tokens: dict[str, int]
    new_req_block_ids: dict[str, list[int]]
    preempted_req_ids: set[str]
    holders: dict[str, list[int]]
    free_block_ids: list[int]
    num_fenced_blocks: int
    late_write: tuple[torch.Tensor, torch.Tensor] | None = None
    collected: bool = False
    holders_at_collect: dict[str, list[int]] = field(default_factory=dict)
    num_fenced_at_collect: int = 0


class LateWriteExecutor(Executor):
    """In-process worker whose step-t KV write is re-applied when step t is collected.

    The scripted model's `forward` is wrapped to record `(slot_mapping, input_ids)` of each
    step; the sample future returned for that step re-applies `model.write_kv(slots, ids)`
    the moment the engine calls its `result()`. Set `kv` to the engine's KV cache manager to
    record block ownership at every step.
    """

    def __init__(self, config: Any, late_writes: bool = True) -> None:
        self.worker = Worker(config)
        self.model = self.worker.model
        self.late_writes = late_writes
        self.kv: KVCacheManager | None = None
        self.records: list[StepRecord] = []
        self._unsampled: deque[StepRecord] = deque()
        self._last_write: tuple[torch.Tensor, torch.Tensor] | None = None
        forward = self.model.forward

        def recording_forward(batch: FlatBatch) -> torch.Tensor:
            self._last_write = (batch.slot_mapping.clone(), batch.input_ids.clone())
            return forward(batch)

        self.model.forward = recording_forward  # type: ignore[method-assign]

    def _holders(self) -> dict[str, list[int]]:
        assert self.kv is not None
        return {rid: self.kv.get_block_ids(rid) for rid in self.kv.req_to_blocks}

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        assert self.kv is not None, "set executor.kv to the engine's KV cache manager"
        self._last_write = None
        future = completed(self.worker.execute_model, scheduler_output)
        record = StepRecord(
            step_id=scheduler_output.step_id,
            num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
            new_req_block_ids={
                r.req_id: list(r.block_ids) for r in scheduler_output.scheduled_new_reqs
            },
            preempted_req_ids=set(scheduler_output.preempted_req_ids),
            holders=self._holders(),
            free_block_ids=[b.block_id for b in self.kv.block_pool.free_block_queue],
            num_fenced_blocks=self.kv.num_fenced_blocks,
            late_write=self._last_write,
        )
        self.records.append(record)
        self._unsampled.append(record)
        return future

    def sample_tokens(self, grammar_bitmask: torch.Tensor | None) -> Future[ModelRunnerOutput]:
        record = self._unsampled.popleft()
        inner = completed(self.worker.sample_tokens, grammar_bitmask)

        def land() -> None:
            record.collected = True
            record.holders_at_collect = self._holders()
            assert self.kv is not None
            record.num_fenced_at_collect = self.kv.num_fenced_blocks
            if self.late_writes and record.late_write is not None:
                self.model.write_kv(*record.late_write)

        return LateFuture(inner, land)

    def record(self, step_id: int) -> StepRecord:
        return next(r for r in self.records if r.step_id == step_id)


def make_engine(late_writes: bool = True, **overrides: Any) -> tuple[EngineCore, LateWriteExecutor]:
    settings: dict[str, Any] = {
        "vocab_size": VOCAB,
        "eos_token_id": EOS,
        "async_scheduling": True,
        "enable_prefix_caching": False,
    }
    settings.update(overrides)
    config = scripted_config(**settings)
    executor = LateWriteExecutor(config, late_writes=late_writes)
    engine = EngineCore(config, executor=executor)
    executor.kv = engine.scheduler_state.kv_cache_manager
    return engine, executor


def expected(prompt: list[int], max_model_len: int, **params: Any) -> tuple[list[int], str]:
    sampling = make_request("x", prompt, **params).sampling_params
    return expected_scripted_output(prompt, sampling, VOCAB, EOS, max_model_len)


def step(engine: EngineCore, outputs: dict[str, list[Any]]) -> None:
    step_outputs, _ = engine.step_fn()
    for out in step_outputs:
        outputs.setdefault(out.request_id, []).append(out)


def drain(engine: EngineCore, outputs: dict[str, list[Any]], max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        step(engine, outputs)
    raise AssertionError("engine did not become idle")


def tokens_and_reason(outs: list[Any]) -> tuple[list[int], str | None]:
    tokens: list[int] = []
    for i, out in enumerate(outs):
        assert out.finish_reason is None or i == len(outs) - 1, f"output after finish: {outs}"
        tokens.extend(out.new_token_ids)
    return tokens, outs[-1].finish_reason


# The abort scenario -----------------------------------------------------------------------

MAX_MODEL_LEN = 16
BLOCK_SIZE = 4
R_PROMPT = [2, 3, 5, 7, 2, 3, 5, 7, 2, 3, 5, 7, 2]  # 13 tokens: R holds all 4 blocks
S_MAX_TOKENS = 2  # S's prompt fills max_model_len - 2 positions


def run_abort_scenario(fence: bool) -> dict[str, Any]:
    """R decodes with a step in flight; abort R and add S; run to completion.

    The pool (4 blocks of 4) is exactly what R holds, so S can only ever get R's blocks.
    """
    engine, executor = make_engine(
        block_size=BLOCK_SIZE,
        num_kv_blocks=MAX_MODEL_LEN // BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=64,
        max_num_seqs=2,
    )
    kv = engine.scheduler_state.kv_cache_manager
    if not fence:
        kv._fence.defer_frees = False  # the negative control: frees skip the fence
    assert kv.defer_frees is fence

    r_expected, _ = expected(R_PROMPT, MAX_MODEL_LEN, max_tokens=3, ignore_eos=True)
    outputs: dict[str, list[Any]] = {}
    engine.add_request(make_request("R", R_PROMPT, max_tokens=3, ignore_eos=True))
    step(engine, outputs)  # step 1 (R's prefill) queued
    step(engine, outputs)  # step 2 (R's first decode) queued; step 1 collected
    assert len(engine.batch_queue) == 1
    in_flight = engine.batch_queue[0][1]
    assert in_flight.num_scheduled_tokens == {"R": 1}, "R must be decoding in flight"
    r_blocks = kv.get_block_ids("R")
    assert len(r_blocks) == kv.num_blocks and kv.num_free_blocks == 0

    # The in-flight step writes R's first output token at position 13: the slot the late
    # write will hit. S's prompt puts a different token there.
    late_slots, late_ids = executor.record(in_flight.step_id).late_write
    assert late_ids.tolist() == [r_expected[0]]
    s_token = 2 if r_expected[0] != 2 else 3
    s_prompt = [s_token] * (MAX_MODEL_LEN - S_MAX_TOKENS)

    engine.abort_requests(["R"])
    engine.add_request(make_request("S", s_prompt, max_tokens=S_MAX_TOKENS, ignore_eos=True))
    step(engine, outputs)  # abort drained, next step scheduled, the R step collected
    next_step = executor.records[-1]
    drain(engine, outputs)
    assert kv.all_blocks_free()
    return {
        "outputs": {rid: tokens_and_reason(outs) for rid, outs in outputs.items()},
        "r_blocks": r_blocks,
        "late_slot": int(late_slots[0]),
        "late_step": executor.record(in_flight.step_id),
        "next_step": next_step,
        "s_prompt": s_prompt,
        "s_expected": expected(s_prompt, MAX_MODEL_LEN, max_tokens=S_MAX_TOKENS, ignore_eos=True),
        "r_expected": r_expected,
        "executor": executor,
    }


def test_fence_keeps_aborted_blocks_from_the_next_request() -> None:
    run = run_abort_scenario(fence=True)
    next_step = run["next_step"]
    # The step planned right after the abort: R's blocks were waiting for the fence.
    assert next_step.num_fenced_blocks == len(run["r_blocks"])
    assert not set(next_step.free_block_ids) & set(run["r_blocks"])
    s_blocks = next_step.new_req_block_ids.get("S", [])
    assert not set(s_blocks) & set(run["r_blocks"])
    # S got R's blocks only once the step that writes them was collected.
    s_step = next(r for r in run["executor"].records if "S" in r.new_req_block_ids)
    assert s_step.step_id > run["late_step"].step_id
    late_step = run["late_step"]
    assert late_step.collected
    # When the late write landed, R's blocks were still fenced and nobody held them.
    assert late_step.num_fenced_at_collect == len(run["r_blocks"])
    assert all(not set(b) & set(run["r_blocks"]) for b in late_step.holders_at_collect.values())
    assert set(s_step.new_req_block_ids["S"]) == set(run["r_blocks"])
    # R ends with abort and what it had; S is exact.
    r_tokens, r_reason = run["outputs"]["R"]
    assert r_reason == "abort"
    assert r_tokens == run["r_expected"][: len(r_tokens)] and len(r_tokens) == 1
    assert run["outputs"]["S"] == run["s_expected"]


def test_without_the_fence_the_late_write_corrupts_the_next_request() -> None:
    """Negative control: the same scenario with the fence off hands R's blocks to S while
    R's step is in flight; the late write overwrites S's prompt KV and S's output changes."""
    run = run_abort_scenario(fence=False)
    next_step = run["next_step"]
    assert next_step.num_fenced_blocks == 0
    s_blocks = next_step.new_req_block_ids["S"]  # admitted in the very next step
    assert set(s_blocks) == set(run["r_blocks"])
    assert next_step.step_id == run["late_step"].step_id + 1
    # When the late write landed, S already held the block it hits.
    assert set(run["late_step"].holders_at_collect["S"]) == set(run["r_blocks"])
    # The late slot lies in S's prompt, at a position holding a different token.
    block, offset = divmod(run["late_slot"], BLOCK_SIZE)
    position = s_blocks.index(block) * BLOCK_SIZE + offset
    assert position < len(run["s_prompt"])
    assert run["s_prompt"][position] != run["r_expected"][0]
    assert run["outputs"]["R"][1] == "abort"
    s_tokens, s_reason = run["outputs"]["S"]
    assert s_reason == "length"
    assert s_tokens != run["s_expected"][0], "the late write did not corrupt S"
    # S's first token was sampled before the late write landed; the second read it back.
    assert s_tokens[0] == run["s_expected"][0][0]


def test_late_writes_alone_do_not_change_outputs() -> None:
    """Sanity check of the executor: with nothing freed early, re-applying each step's
    write at collection is harmless and every output is exact."""
    engine, _ = make_engine(
        block_size=2, num_kv_blocks=40, max_model_len=64, max_num_batched_tokens=7, max_num_seqs=3
    )
    prompts = [[2, 3, 5] * 5, [7] * 20, [3, 2], [5, 5, 7, 2] * 4]
    for i, prompt in enumerate(prompts):
        engine.add_request(make_request(f"q{i}", prompt, max_tokens=12))
    outputs: dict[str, list[Any]] = {}
    drain(engine, outputs)
    for i, prompt in enumerate(prompts):
        assert tokens_and_reason(outputs[f"q{i}"]) == expected(prompt, 64, max_tokens=12)


# Preemption with a step in flight ---------------------------------------------------------


def test_preempted_blocks_wait_for_the_in_flight_step() -> None:
    """A and B decode in a pool they fill; A's next block forces B's preemption while a
    step holding B is in flight. B's blocks are fenced (not free) until that step is
    processed, then they return to the pool; both requests still finish exactly."""
    max_model_len, block_size = 32, 4
    engine, executor = make_engine(
        block_size=block_size,
        num_kv_blocks=max_model_len // block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=64,
        max_num_seqs=2,
    )
    kv = engine.scheduler_state.kv_cache_manager
    a_prompt, b_prompt = [2, 3, 5, 7] * 3 + [2, 2], [7, 5, 3] * 4 + [3]  # 14 and 13 tokens
    engine.add_request(make_request("A", a_prompt, max_tokens=10, ignore_eos=True))
    engine.add_request(make_request("B", b_prompt, max_tokens=10, ignore_eos=True))
    outputs: dict[str, list[Any]] = {}
    preempting: StepRecord | None = None
    for _ in range(200):
        if not engine.has_work():
            break
        before = len(executor.records)
        step(engine, outputs)
        new = [r for r in executor.records[before:] if r.preempted_req_ids]
        if new and preempting is None:
            preempting = new[0]
            # Around the preemption: planned while the previous step (holding B) was in
            # flight, B's blocks were fenced, not free, and nobody got them.
            prior = executor.records[executor.records.index(preempting) - 1]
            assert preempting.preempted_req_ids == {"B"}
            assert "B" in prior.num_scheduled_tokens
            b_blocks = prior.holders["B"]
            assert "B" not in preempting.holders
            assert preempting.num_fenced_blocks == len(b_blocks) > 0
            assert not set(preempting.free_block_ids) & set(b_blocks)
            assert all(not set(b) & set(b_blocks) for b in preempting.holders.values())
            # This engine step then collected the in-flight step: the fence passed and
            # B's blocks are back in the free pool (nothing was allocated since).
            assert prior.collected
            assert prior.num_fenced_at_collect == len(b_blocks)  # still fenced until then
            assert kv.num_fenced_blocks == 0
            free_now = [b.block_id for b in kv.block_pool.free_block_queue]
            assert set(b_blocks) <= set(free_now)
            assert kv.num_free_blocks == len(preempting.free_block_ids) + len(b_blocks)
    assert preempting is not None, "the scenario did not preempt"
    assert kv.all_blocks_free()
    assert tokens_and_reason(outputs["A"]) == expected(
        a_prompt, max_model_len, max_tokens=10, ignore_eos=True
    )
    assert tokens_and_reason(outputs["B"]) == expected(
        b_prompt, max_model_len, max_tokens=10, ignore_eos=True
    )


# Random workloads with late writes ----------------------------------------------------------


@st.composite
def late_write_workloads(draw: st.DrawFn) -> dict[str, Any]:
    block_size = draw(st.integers(1, 6))
    max_model_len = draw(st.integers(24, 48))
    min_blocks = -(-max_model_len // block_size)
    requests = []
    for i in range(draw(st.integers(2, 8))):
        length = draw(st.integers(1, max_model_len // 2))
        requests.append(
            {
                "rid": f"w{i}",
                "prompt": draw(
                    st.lists(st.sampled_from([2, 3, 5]), min_size=length, max_size=length)
                ),
                "max_tokens": draw(st.integers(1, 24)),
                "ignore_eos": draw(st.booleans()),
                "arrival": draw(st.integers(0, 8)),
                "abort_after": draw(st.one_of(st.none(), st.integers(0, 10))),
                "priority": draw(st.integers(0, 2)),
            }
        )
    return {
        "limits": {
            "block_size": block_size,
            "max_model_len": max_model_len,
            "num_kv_blocks": draw(st.integers(min_blocks, 2 * min_blocks)),
            "max_num_batched_tokens": draw(st.integers(1, 32)),
            "max_num_seqs": draw(st.integers(1, 6)),
            "enable_prefix_caching": draw(st.booleans()),
            "scheduling_policy": draw(st.sampled_from(["fcfs", "priority"])),
        },
        "requests": requests,
    }


def run_late_write_workload(workload: dict[str, Any], fence: bool = True) -> dict[str, Any]:
    """Drive an async engine with late KV writes; return per-request (tokens, reason)."""
    limits = workload["limits"]
    engine, _ = make_engine(**limits)
    if not fence:
        engine.scheduler_state.kv_cache_manager._fence.defer_frees = False
    outputs: dict[str, list[Any]] = {}
    requests = workload["requests"]
    last = max(r["arrival"] + (r["abort_after"] or 0) for r in requests)
    for step_index in range(10_000):
        for r in requests:
            if r["arrival"] == step_index:
                engine.add_request(
                    make_request(
                        r["rid"],
                        r["prompt"],
                        priority=r["priority"],
                        arrival_time=float(step_index * 100 + int(r["rid"][1:])),
                        max_tokens=r["max_tokens"],
                        ignore_eos=r["ignore_eos"],
                    )
                )
            if r["abort_after"] is not None and r["arrival"] + r["abort_after"] == step_index:
                engine.abort_requests([r["rid"]])
        if step_index > last and not engine.has_work():
            break
        step(engine, outputs)
    else:
        raise AssertionError("engine did not become idle")
    assert engine.scheduler_state.kv_cache_manager.all_blocks_free()
    return {rid: tokens_and_reason(outs) for rid, outs in outputs.items()}


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=late_write_workloads())
def test_late_writes_never_reach_another_request(workload: dict[str, Any]) -> None:
    """Under async scheduling with every KV write landing when its step is collected,
    random arrivals, aborts, preemptions and prefix hits over tiny pools still give every
    request its exact greedy tokens (aborted ones: a prefix, ending in "abort")."""
    results = run_late_write_workload(workload)
    max_model_len = workload["limits"]["max_model_len"]
    for r in workload["requests"]:
        want_tokens, want_reason = expected(
            r["prompt"], max_model_len, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"]
        )
        tokens, reason = results[r["rid"]]
        if reason == "abort":
            assert r["abort_after"] is not None
            assert tokens == want_tokens[: len(tokens)] and len(tokens) < len(want_tokens)
        else:
            assert (tokens, reason) == (want_tokens, want_reason), r
