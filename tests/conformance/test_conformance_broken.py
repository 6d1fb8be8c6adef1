"""Negative controls: deliberately broken schedulers fail the conformance suite, each with
the check, the mode and the rule that names its bug.

Each is a small subclass of `ReferenceScheduler`. They reach the suite the way a
third-party plugin does, by name through the entry-point group `tandem.plugins`: either
registered under a chosen name with `registered_plugins` (the name path users take) or
passed as a class to `run_conformance`, which registers it under `test-<kebab-name>`.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from tandem.core import hookimpl
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.outputs import EngineCoreOutput
from tandem.core.plugin_manager import TandemPluginManager
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler_output import NewRequestData, SchedulerOutput
from tandem.plugins.reference_scheduler import ReferenceScheduler
from tandem.plugins.request_queue import FCFSQueue
from tandem.schema.config import EngineConfig
from tandem.testing.conformance import (
    CHECK_LIST,
    CHECKS,
    ConformanceError,
    ConformanceReport,
    registered_plugins,
    run_conformance,
)


class ForgetsPlaceholders(ReferenceScheduler):
    """Never resolves output placeholders when a step's tokens come back (inert under
    sync scheduling, where there are none)."""

    def _append_output(self, request: Request, new_token_ids: list[int]) -> tuple[list[int], bool]:
        placeholders = request.num_output_placeholders
        result = super()._append_output(request, new_token_ids)
        request.num_output_placeholders = placeholders  # the bug
        return result


class AdmitsAfterPreemption(ReferenceScheduler):
    """Spends the budget left in a step that preempted on WAITING requests."""

    @hookimpl  # an override of a hook must be marked again, or the hook goes unanswered
    def schedule(self) -> SchedulerOutput:
        output = super().schedule()
        if not output.preempted_req_ids:
            return output
        budget = self.max_num_batched_tokens - output.total_num_scheduled_tokens
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_running_reqs:
            request = self.waiting.peek()
            hits, num_hits = kv.get_computed_blocks(request)
            num_new = self._num_new_tokens(request, budget, num_hits)
            if num_new <= 0:
                break
            blocks = kv.allocate_slots(
                request, num_new, num_new_computed_tokens=num_hits, new_computed_blocks=hits
            )
            if blocks is None:
                break
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hits
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hits
            output.scheduled_new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_hits,
                    eos_token_id=request.eos_token_id,
                )
            )
            output.num_scheduled_tokens[request.request_id] = num_new
            output.total_num_scheduled_tokens += num_new
            budget -= num_new
        return output


class LeaksOnAbort(ReferenceScheduler):
    """Forgets aborted requests without freeing their KV blocks."""

    @hookimpl
    def abort_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status != RequestStatus.RUNNING:
                self.waiting.discard([request])
            request.status = status
            self.finished_req_ids.add(request_id)
            del self.requests[request_id]  # the bug: no self.kv_cache_manager.free(request_id)
        self.running = [r for r in self.running if not r.is_finished]


class _NewestFirst(FCFSQueue):
    def add(self, request: Request) -> None:
        self._queue.appendleft(request)


class StarvingScheduler(ReferenceScheduler):
    """Admits the newest WAITING request first (LIFO): while requests keep arriving, the
    oldest waiting one starves."""

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        self.waiting = _NewestFirst()


class DoubleCountsResults(ReferenceScheduler):
    """Subtracts each processed step's tokens from `num_in_flight_tokens` twice: the
    kernel's own invariant check catches it."""

    @hookimpl
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is not None and request.num_stale_output_tokens == 0:
                request.num_in_flight_tokens -= num_tokens  # the bug
        return super().update_from_output(scheduler_output, model_runner_output)


class SkipsOneTokenPrompts(ReferenceScheduler):
    """Never admits a request whose prompt is a single token: it waits forever."""

    @hookimpl
    def schedule(self) -> SchedulerOutput:
        hidden = [r for r in self.waiting if r.num_prompt_tokens == 1]
        self.waiting.discard(hidden)
        try:
            return super().schedule()
        finally:
            for request in hidden:
                self.waiting.add(request)


def failed(report: ConformanceReport) -> dict[tuple[str, str], ConformanceError]:
    return {(r.check, r.mode): r.error for r in report.results if r.error is not None}


def assert_well_formed(error: ConformanceError, plugin: str) -> None:
    """The error names the plugin, check, mode, step, rule, request and its ledger."""
    message = str(error)
    assert error.plugin == plugin
    assert f"failed check {error.check!r} [{error.mode}]" in message
    assert error.step > 0 and f"at step {error.step}" in message
    assert f"invariant: {error.invariant}" in message
    assert error.request_id is not None and f"request: {error.request_id}" in message
    assert error.ledger is not None and error.ledger["request_id"] == error.request_id
    assert "ledger: {" in message


class IgnoresGrammarReady(ReferenceScheduler):
    """Admits a request whose grammar is still compiling: never asks `requests_not_ready`."""

    @hookimpl
    def tandem_stack_loaded(self, manager: TandemPluginManager) -> None:
        super().tandem_stack_loaded(manager)
        self.policy_hooks.not_ready = lambda: ()  # type: ignore[method-assign]  # the bug


class BlocksBehindGrammar(ReferenceScheduler):
    """Admits nobody while the oldest waiting request's grammar is compiling."""

    @hookimpl
    def schedule(self) -> SchedulerOutput:
        head = self.waiting.peek() if self.waiting else None
        if head is None or head.request_id not in self.policy_hooks.not_ready():
            return super().schedule()
        limit, self.max_num_running_reqs = self.max_num_running_reqs, len(self.running)
        try:
            return super().schedule()  # the bug: RUNNING only, the queue waits for the head
        finally:
            self.max_num_running_reqs = limit


def test_ignoring_grammar_ready_fails_the_grammar_ready_check() -> None:
    report = run_conformance(IgnoresGrammarReady)
    failures = failed(report)
    assert set(failures) == {("grammar-ready", "sync"), ("grammar-ready", "async")}, (
        report.summary()
    )
    for error in failures.values():
        assert_well_formed(error, "test-ignores-grammar-ready")
        assert error.invariant == "a request is not scheduled while a plugin reports it not ready"
        assert "its grammar is ready after step" in error.detail


def test_blocking_behind_a_compiling_grammar_fails_the_grammar_ready_check() -> None:
    report = run_conformance(BlocksBehindGrammar, checks=["grammar-ready", "greedy-parity"])
    failures = failed(report)
    assert set(failures) == {("grammar-ready", "sync"), ("grammar-ready", "async")}, (
        report.summary()
    )
    for error in failures.values():
        assert_well_formed(error, "test-blocks-behind-grammar")
        assert error.invariant.startswith("a request waiting for its grammar does not block")


def test_forgotten_placeholders_fail_every_async_check_and_no_sync_one() -> None:
    report = run_conformance(ForgetsPlaceholders)
    failures = failed(report)
    assert set(failures) == {(check, "async") for check in CHECKS}, report.summary()
    for error in failures.values():
        assert_well_formed(error, "test-forgets-placeholders")
        assert error.invariant.startswith("num_output_placeholders <= num_in_flight_tokens")
        assert error.ledger is not None
        assert error.ledger["num_output_placeholders"] > error.ledger["num_in_flight_tokens"]  # type: ignore[operator]
    # Caught as soon as the first sampled result is processed (the step after the first
    # complete prefill): its placeholder is never resolved.
    assert failures["greedy-parity", "async"].step <= 3


def test_admission_in_a_preempting_step_fails_the_preemption_check() -> None:
    report = run_conformance(AdmitsAfterPreemption, checks=["preemption", "greedy-parity"])
    failures = failed(report)
    assert ("preemption", "sync") in failures, report.summary()
    assert report.result("greedy-parity", "sync").passed  # no preemption there: no bug
    for error in failures.values():
        assert_well_formed(error, "test-admits-after-preemption")
        assert error.invariant == "no WAITING request is admitted in a step that preempted"
        assert "were preempted in the same step" in error.detail


def test_leaking_blocks_on_abort_fails_the_abort_check_by_name() -> None:
    with registered_plugins({"leaky-abort-scheduler": LeaksOnAbort}):
        report = run_conformance("leaky-abort-scheduler")
    failures = failed(report)
    assert set(failures) == {("abort", "sync"), ("abort", "async")}, report.summary()
    for error in failures.values():
        assert_well_formed(error, "leaky-abort-scheduler")
        assert error.invariant.startswith("KV blocks are held only by live requests")
        assert error.ledger is not None and error.ledger["status"] == "FINISHED_ABORTED"
        assert "holds blocks" in error.detail


def test_starving_the_oldest_request_fails_the_bounded_wait_check() -> None:
    report = run_conformance(StarvingScheduler)
    failures = failed(report)
    assert set(failures) == {("bounded-wait", "sync"), ("bounded-wait", "async")}, report.summary()
    for error in failures.values():
        assert_well_formed(error, "test-starving-scheduler")
        assert error.invariant.startswith("bounded wait")
        assert error.ledger is not None and error.ledger["status"] == "WAITING"


def test_a_kernel_invariant_violation_is_reported_with_its_request() -> None:
    report = run_conformance(DoubleCountsResults, checks=["greedy-parity"])
    failures = failed(report)
    assert set(failures) == {("greedy-parity", "sync"), ("greedy-parity", "async")}
    for error in failures.values():
        assert_well_formed(error, "test-double-counts-results")
        assert error.invariant == "num_in_flight_tokens >= 0"
        assert error.ledger is not None and error.ledger["num_in_flight_tokens"] < 0  # type: ignore[operator]


def test_a_request_that_never_runs_fails_the_step_cap() -> None:
    report = run_conformance(SkipsOneTokenPrompts, checks=["all-finish"])
    failures = failed(report)
    assert set(failures) == {("all-finish", "sync"), ("all-finish", "async")}
    (workload,) = next(c for c in CHECK_LIST if c.name == "all-finish").workloads
    for error in failures.values():
        assert_well_formed(error, "test-skips-one-token-prompts")
        assert error.invariant == "every request finishes within the step cap"
        assert error.step == workload.step_cap()
        assert error.request_id == "prompt-1"
        assert error.ledger is not None and error.ledger["status"] == "WAITING"


def test_raise_for_failures_names_every_failed_item() -> None:
    report = run_conformance(StarvingScheduler, checks=["bounded-wait", "all-finish"])
    with pytest.raises(ConformanceError, match=r"(?s)bounded wait.*also failed: bounded-wait"):
        report.raise_for_failures()
    assert "FAIL bounded-wait" in report.summary()
    assert "PASS all-finish" in report.summary()


def test_registered_names_cannot_shadow_installed_plugins() -> None:
    with (
        pytest.raises(ValueError, match="reference-scheduler"),
        registered_plugins({"reference-scheduler": StarvingScheduler}),
    ):
        pass


def test_unknown_plugin_is_a_stack_failure() -> None:
    report = run_conformance("no-such-scheduler", checks=["greedy-parity"], modes=("sync",))
    (result,) = report.results
    assert result.error is not None
    assert result.error.invariant == "the stack loads and starts"
    assert "unknown plugin 'no-such-scheduler'" in result.error.detail


def _options_are_passed(**options: Any) -> ConformanceReport:
    return run_conformance(
        "reference-scheduler", options, checks=["greedy-parity"], modes=("sync",)
    )


def test_plugin_options_reach_the_plugin() -> None:
    report = _options_are_passed(colour="blue")
    (result,) = report.results
    assert result.error is not None
    assert "colour" in result.error.detail
