"""The structured-output plugin on its own: compile off the hot path (readiness, cache,
errors, time-outs), the batch bitmask with spec rows (sync drafts, async placeholders with
the worker's kept drafts, padding, rejected drafts) and matcher advance from the ledger."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from so_helpers import SCHEMA, allowed, fill

from tandem import SamplingParams
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.request import Request
from tandem.core.scheduler_output import SchedulerOutput
from tandem.schema.config import EngineConfig
from tandem.schema.request_checks import RequestRejectedError
from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.structured_output.backend import allocate_bitmask
from tandem.structured_output.manager import StructuredOutputManager

VOCAB = 49152


class BlockingBackend:
    """Occupies a compile worker until released."""

    name = "blocking"

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def compile(self, spec: Any) -> None:
        self.release.wait(30)


def make_manager(config: EngineConfig, **options: Any) -> StructuredOutputManager:
    return StructuredOutputManager(config, StructuredOutputManager.Options(**options))


def constrained(rid: str, **spec: Any) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0, structured_outputs=spec),
        eos_token_id=2,
    )


def wait_ready(manager: StructuredOutputManager, *requests: Request) -> list:
    finished = []
    deadline = time.monotonic() + 30
    while set(manager.requests_not_ready() or ()) & {r.request_id for r in requests}:
        finished += manager.poll_finished_requests() or []
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return finished


def step(rids: list[str], spec: dict[str, list[int]] | None = None) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=1,
        num_scheduled_tokens=dict.fromkeys(rids, 1),
        total_num_scheduled_tokens=len(rids),
        scheduled_spec_decode_tokens=spec or {},
        structured_output_request_ids=list(rids),
    )


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_request_becomes_ready_once_compiled_and_the_cache_shares_compiles(
    smollm2_config: EngineConfig, backend: str
) -> None:
    manager = make_manager(smollm2_config, backend=backend)
    a, b = constrained("a", json=SCHEMA), constrained("b", json=SCHEMA)
    manager.add_request(a)
    manager.add_request(b)
    assert set(manager.requests_not_ready() or ()) == {"a", "b"}  # not before a poll
    assert wait_ready(manager, a, b) == []
    assert manager.pool.num_compiles == 1
    assert manager._states["a"].backend.name == backend


def test_spec_rows_fill_accept_fill_then_roll_back(
    smollm2_config: EngineConfig, tokenizer: Any
) -> None:
    manager = make_manager(smollm2_config)
    request = constrained("r", json=SCHEMA)
    manager.add_request(request)
    wait_ready(manager, request)
    good = tokenizer.encode('{"x":')
    bad = tokenizer.encode("hello")[0]
    drafts = [good[0], good[1], bad]  # the third is rejected by the grammar
    bitmask = manager.grammar_bitmask(step(["r"], {"r": drafts}))
    assert bitmask is not None and bitmask.shape == (4, (VOCAB + 31) // 32)
    matcher = manager._states["r"].matcher
    rows = [fill(matcher, VOCAB)]
    for token in drafts[:2]:
        assert matcher.accept_token(token)
        rows.append(fill(matcher, VOCAB))
    matcher.rollback(2)
    assert [allowed(bitmask, i, VOCAB) for i in range(3)] == rows
    assert bool((bitmask[3] == -1).all())  # after the rejected draft: never used
    assert fill(matcher, VOCAB) == rows[0]  # rolled back to the confirmed prefix


def test_async_placeholder_rows_use_the_requests_proposal_padded_with_zero(
    smollm2_config: EngineConfig, tokenizer: Any
) -> None:
    manager = make_manager(smollm2_config)
    request = constrained("r", regex="[0-9]+")
    manager.add_request(request)
    wait_ready(manager, request)
    digits = tokenizer.encode("1")[0], tokenizer.encode("2")[0]
    # The step before: the scheduler appended "1" and recorded the worker's proposal ("2").
    request.all_token_ids.append(digits[0])
    request.draft_token_ids = [digits[1]]
    output = ModelRunnerOutput(
        req_ids=["r"],
        req_id_to_index={"r": 0},
        sampled_token_ids=[[digits[0]]],
        draft_token_ids={"r": [digits[1]]},
    )
    manager.update_from_output(step(["r"]), output)
    assert manager._states["r"].num_consumed == 1
    bitmask = manager.grammar_bitmask(step(["r"], {"r": [-1, -1]}))
    assert bitmask is not None and bitmask.shape[0] == 3
    matcher = manager._states["r"].matcher
    first = fill(matcher, VOCAB)
    assert allowed(bitmask, 0, VOCAB) == first
    assert allowed(bitmask, 1, VOCAB) == first  # after "2" digits still follow
    assert bool((bitmask[2] == -1).all())  # padding token 0 is not a digit: rejected
    assert 0 not in first


def test_preemption_keeps_the_matcher_and_pads_placeholders_without_a_proposal(
    smollm2_config: EngineConfig, tokenizer: Any
) -> None:
    """A preempted request resumes mid-grammar: its matcher stays at the confirmed prefix;
    its proposal is gone (the worker drops it and the scheduler clears
    `Request.draft_token_ids`: tests/engine/test_runner_drafts.py), so placeholder rows pad
    with 0."""
    manager = make_manager(smollm2_config)
    request = constrained("r", regex="[0-9]+")
    manager.add_request(request)
    wait_ready(manager, request)
    one, two = tokenizer.encode("1")[0], tokenizer.encode("2")[0]
    request.all_token_ids.append(one)
    request.draft_token_ids = [two]
    proposed = ModelRunnerOutput(req_ids=["r"], draft_token_ids={"r": [two]})
    manager.update_from_output(step(["r"]), proposed)
    preempting = SchedulerOutput(step_id=2, preempted_req_ids={"r"})
    request.draft_token_ids = []  # what the scheduler does on the preempting step's results
    manager.update_from_output(preempting, ModelRunnerOutput())
    state = manager._states["r"]
    assert state.num_consumed == 1
    assert manager.num_preempted_mid_grammar == 1
    bitmask = manager.grammar_bitmask(step(["r"], {"r": [-1]}))
    assert bitmask is not None and bool((bitmask[1] == -1).all())  # padding 0: rejected


def test_matcher_follows_the_confirmed_prefix_and_terminates(
    smollm2_config: EngineConfig, tokenizer: Any
) -> None:
    manager = make_manager(smollm2_config, backend="outlines")
    request = constrained("r", choice=["yes", "no"])
    request.sampling_params.ignore_eos = True  # the scheduler would not stop at EOS
    manager.add_request(request)
    wait_ready(manager, request)
    so = step(["r"])
    tokens = [*tokenizer.encode("yes"), 2]
    request.all_token_ids.extend(tokens)
    manager.update_from_output(so, ModelRunnerOutput(req_ids=["r"]))
    finished = manager.poll_finished_requests()
    assert finished is not None and [(f.request_id, f.finish_reason) for f in finished] == [
        ("r", "stop")
    ]
    assert "r" not in manager._states


def test_a_token_outside_the_grammar_fails_only_that_request(
    smollm2_config: EngineConfig, tokenizer: Any
) -> None:
    manager = make_manager(smollm2_config)
    bad, good = constrained("bad", regex="[0-9]+"), constrained("good", regex="[0-9]+")
    manager.add_request(bad)
    manager.add_request(good)
    wait_ready(manager, bad, good)
    bad.all_token_ids.append(tokenizer.encode("x")[0])
    good.all_token_ids.append(tokenizer.encode("7")[0])
    manager.update_from_output(step(["bad", "good"]), ModelRunnerOutput())
    finished = manager.poll_finished_requests() or []
    assert [(f.request_id, f.finish_reason) for f in finished] == [("bad", "error")]
    assert "violates the grammar" in (finished[0].error or "")
    assert manager._states["good"].num_consumed == 1


def test_compile_error_and_time_out_fail_their_request(smollm2_config: EngineConfig) -> None:
    manager = make_manager(smollm2_config)
    broken = constrained("broken", grammar="root ::= (")  # passes the checks, fails to compile
    manager.add_request(broken)
    deadline = time.monotonic() + 30
    finished: list = []
    while not finished:
        finished = manager.poll_finished_requests() or []
        assert time.monotonic() < deadline
    assert finished[0].request_id == "broken" and finished[0].finish_reason == "error"
    assert "structured_outputs.grammar" in finished[0].error and "xgrammar" in finished[0].error
    assert "broken" not in (manager.requests_not_ready() or ())  # failed: ended, not waiting
    assert "broken" not in manager._states

    slow = make_manager(smollm2_config, compile_timeout_s=0.01, max_compile_workers=1)
    release = threading.Event()
    blocker = slow.pool.submit(BlockingBackend(release), broken.sampling_params.structured_outputs)
    request = constrained("slow", json=SCHEMA)
    slow.add_request(request)  # queued behind the blocked worker: cannot finish in time
    time.sleep(0.05)
    timed_out = slow.poll_finished_requests() or []
    release.set()
    blocker.result()
    assert [(f.request_id, f.finish_reason) for f in timed_out] == [("slow", "error")]
    assert "compile_timeout_s" in (timed_out[0].error or "")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": SCHEMA, "backend": "nope"}, "structured_outputs.backend: unknown backend 'nope'"),
        ({"grammar": 'root ::= "a"', "backend": "outlines"}, "use backend 'xgrammar'"),
        ({"regex": "(?!a)b"}, "unsupported regex feature"),
        ({"custom": {"modulus": 3}}, "structured_outputs.custom"),
        ({"json": {"type": "nonsense"}}, "structured_outputs.json: [$].type: expected one of"),
        (
            {"json": {"type": "array", "uniqueItems": True}, "backend": "auto"},
            "structured_outputs.json: [$].uniqueItems: not enforced by xgrammar or outlines-core",
        ),
    ],
)
def test_synchronous_errors_name_the_field(
    smollm2_config: EngineConfig, spec: dict, message: str
) -> None:
    manager = make_manager(smollm2_config)
    with pytest.raises(RequestRejectedError, match=message.replace("(", r"\(")):
        manager.add_request(constrained("r", **spec))
    assert "r" not in manager._states


def test_no_constrained_request_no_bitmask(smollm2_config: EngineConfig) -> None:
    manager = make_manager(smollm2_config)
    assert manager.grammar_bitmask(step([])) is None
    assert isinstance(allocate_bitmask(1, VOCAB), torch.Tensor)


def test_pathological_regex_times_out_alone(smollm2_config: EngineConfig) -> None:
    """A regex whose DFA explodes ((a|b)*a(a|b){9}: 2^10 states, seconds to index on
    outlines-core) fails its request by time-out; a request compiled beside it is ready."""
    manager = make_manager(smollm2_config, backend="outlines", compile_timeout_s=0.3)
    slow = constrained("slow", regex="(a|b)*a(a|b){9}")
    fast = constrained("fast", regex="[0-9]{3}")
    manager.add_request(slow)
    manager.add_request(fast)
    finished: list = []
    deadline = time.monotonic() + 30
    while not finished or "fast" in (manager.requests_not_ready() or ()):
        finished += manager.poll_finished_requests() or []
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [(f.request_id, f.finish_reason) for f in finished] == [("slow", "error")]
    assert "did not compile it within compile_timeout_s=0.3" in (finished[0].error or "")
    assert "fast" in manager._states and "slow" not in manager._states


def test_idle_engine_waits_for_a_compile_instead_of_spinning(
    smollm2_config: EngineConfig,
) -> None:
    from tandem.core.engine_core import IDLE_WAIT_S

    manager = make_manager(smollm2_config, max_compile_workers=1)
    release = threading.Event()
    spec = StructuredOutputsParams(regex="[0-9]+")
    blocker = manager.pool.submit(BlockingBackend(release), spec)
    request = constrained("r", regex="[a-z]+")
    manager.add_request(request)  # queued behind the blocked worker
    assert returns_while_blocked(manager.poll_finished_requests)  # a drain point never waits
    assert not blocker.done()
    started = time.monotonic()
    manager.wait_for_work(timeout_s=IDLE_WAIT_S)  # the idle engine: waits for a compile
    idle = time.monotonic() - started
    release.set()
    blocker.result()
    assert idle >= IDLE_WAIT_S  # it waited (a wait lasts at least its timeout)
    wait_ready(manager, request)
    # nothing compiling: returns without waiting out a 600 s timeout
    assert returns_while_blocked(lambda: manager.wait_for_work(timeout_s=600.0))


def returns_while_blocked(call: Any, limit_s: float = 60.0) -> bool:
    """Whether `call()` returns within `limit_s` (far below any wait it could be stuck in;
    no bound on how fast it is)."""
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(limit_s)
    return not thread.is_alive()


def test_auto_takes_the_first_backend_that_enforces_the_whole_constraint(
    smollm2_config: EngineConfig,
) -> None:
    manager = make_manager(smollm2_config)  # the config's default backend: auto
    assert manager.default_backend == "auto"
    plain = constrained("plain", json=SCHEMA)
    huge = constrained("huge", json={"type": "integer", "minimum": 10**20})  # beyond int64
    for request in (plain, huge):
        manager.add_request(request)
    chosen = {rid: state.backend.name for rid, state in manager._states.items()}
    assert chosen == {"plain": "xgrammar", "huge": "outlines"}
    assert manager.auto_choices == {"xgrammar": 1, "outlines": 1}
    assert wait_ready(manager, plain, huge) == []
    # A schema only xgrammar enforces is refused when outlines is asked for by name.
    counted = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}
    manager.add_request(constrained("auto-counted", json=counted))
    assert manager._states["auto-counted"].backend.name == "xgrammar"
    with pytest.raises(RequestRejectedError, match=r"\$.minProperties: not enforced by outlines"):
        manager.add_request(constrained("outlines-counted", json=counted, backend="outlines"))
    # Neither enforces it: one message naming the keyword and both backends.
    with pytest.raises(
        RequestRejectedError,
        match=r"request none: structured_outputs.json: \$.uniqueItems: not enforced by "
        r"xgrammar or outlines-core",
    ):
        manager.add_request(constrained("none", json={"type": "array", "uniqueItems": True}))


class RaisingMatcher:
    """Stands in for one request's matcher whose library call raises."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def is_terminated(self) -> bool:
        return False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        raise RuntimeError("matcher state corrupted")

    def accept_token(self, token: int) -> bool:
        raise RuntimeError("matcher state corrupted")

    @property
    def matcher(self) -> Any:  # the library object a batched fill reads
        raise RuntimeError("matcher state corrupted")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_a_matcher_that_raises_ends_only_its_request(
    smollm2_config: EngineConfig, backend: str
) -> None:
    """Before: the exception left the hook and stopped the engine for every request."""
    manager = make_manager(smollm2_config, backend=backend)
    good, bad = constrained("good", json=SCHEMA), constrained("bad", json=SCHEMA)
    manager.add_request(good)
    manager.add_request(bad)
    wait_ready(manager, good, bad)
    reference = manager.grammar_bitmask(step(["good"]))
    assert reference is not None
    manager._states["bad"].matcher = RaisingMatcher(manager._states["bad"].matcher)
    bitmask = manager.grammar_bitmask(step(["good", "bad"]))
    assert bitmask is not None
    assert torch.equal(bitmask[0], reference[0])  # the healthy row is as before
    assert bool((bitmask[1] == -1).all())  # the failed one allows everything
    finished = manager.poll_finished_requests() or []
    assert [(f.request_id, f.finish_reason) for f in finished] == [("bad", "error")]
    assert "grammar failed" in (finished[0].error or "")
    assert "good" in manager._states and "bad" not in manager._states
