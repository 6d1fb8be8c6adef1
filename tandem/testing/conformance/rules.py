"""The per-step and end-of-run rules of the conformance suite (see the package docstring)."""

from __future__ import annotations

from collections.abc import Mapping

from tandem.core.engine_core import EngineCore
from tandem.core.request import Request
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.scheduler_state import SchedulerState
from tandem.plugins.invariant_checker import InvariantViolation, check_invariants
from tandem.testing.conformance.report import ConformanceError
from tandem.testing.conformance.workloads import EOS, VOCAB, Mode, Outputs, RequestSpec, Workload
from tandem.testing.engine import expected_scripted_output
from tandem.testing.scripted_diffusion import expected_scripted_diffusion_output


class DriverRules:
    """The rules a conformance run checks, as methods of `_Driver` (run.py): the
    `schedule` and `update_after_schedule` contracts, ledger, placeholder and KV rules
    after every step, the idle state, the waiting bound, and the end of a run."""

    plugin: str
    workload: Workload
    mode: Mode
    step: int
    engine: EngineCore
    requests: dict[str, Request]
    specs: dict[str, RequestSpec]
    tokens: dict[str, list[int]]
    finish: dict[str, str | None]
    arrival: dict[str, int]
    first_scheduled: dict[str, int]
    wait_bounds: dict[str, int]
    preemptions: int
    preempted_counts: dict[str, int]
    max_num_seqs: int
    max_num_batched_tokens: int
    seeded_expected: Outputs | None
    kind: str

    def error(self, invariant: str, detail: str, request_id: str | None = None) -> ConformanceError:
        raise NotImplementedError

    def state(self) -> SchedulerState:
        raise NotImplementedError

    def from_violation(self, exc: InvariantViolation) -> ConformanceError:
        raise NotImplementedError

    def check_schedule(self, output: object, running_before: Mapping[str, int]) -> None:
        """The `schedule` contract, right after the plugin answered."""
        if not isinstance(output, SchedulerOutput):
            raise self.error("schedule returns a SchedulerOutput", f"got {output!r}")
        state = self.state()
        scheduled = output.num_scheduled_tokens
        for rid in scheduled:
            self.first_scheduled.setdefault(rid, self.step)
        if output.preempted_req_ids:
            self.preemptions += len(output.preempted_req_ids)
            self.check_preemption_bound(output.preempted_req_ids)
            if output.scheduled_new_reqs:
                admitted = output.scheduled_new_reqs[0].req_id
                raise self.error(
                    "no WAITING request is admitted in a step that preempted",
                    f"{admitted} admitted while {sorted(output.preempted_req_ids)} "
                    f"were preempted in the same step",
                    admitted,
                )
        for rid, n in scheduled.items():
            ready_at = self.specs[rid].ready_at if rid in self.specs else None
            if ready_at is not None and self.step <= ready_at:
                raise self.error(
                    "a request is not scheduled while a plugin reports it not ready",
                    f"{rid} scheduled in step {self.step}; its grammar is ready after step "
                    f"{ready_at}",
                    rid,
                )
            request = self.requests.get(rid)
            if request is None or rid not in state.requests or request.is_finished:
                raise self.error(
                    "only live requests are scheduled",
                    f"{rid} scheduled for {n} tokens but it is not a live request",
                    rid,
                )
            if n <= 0:
                raise self.error(
                    "every scheduled request gets num_scheduled_tokens > 0",
                    f"{rid} scheduled for {n} tokens",
                    rid,
                )
            work = (
                request.num_tokens_with_spec
                + request.num_output_placeholders
                - request.num_computed_tokens
            )
            if n > work:
                raise self.error(
                    "num_scheduled_tokens <= num_tokens_with_spec + num_output_placeholders "
                    "- num_computed_tokens",
                    f"{rid} scheduled for {n} tokens, its outstanding work is {work}",
                    rid,
                )
        total = sum(scheduled.values())
        if output.total_num_scheduled_tokens != total:
            raise self.error(
                "total_num_scheduled_tokens == sum(num_scheduled_tokens)",
                f"total_num_scheduled_tokens {output.total_num_scheduled_tokens} != {total}",
            )
        if total > self.max_num_batched_tokens:
            raise self.error(
                "total_num_scheduled_tokens <= max_num_batched_tokens",
                f"{total} tokens scheduled, budget {self.max_num_batched_tokens}",
            )
        if len(state.running) > self.max_num_seqs:
            raise self.error(
                "at most max_num_seqs requests RUNNING",
                f"{len(state.running)} RUNNING, max_num_seqs {self.max_num_seqs}",
                state.running[-1].request_id,
            )
        named = [r.req_id for r in output.scheduled_new_reqs]
        named += [r.req_id for r in output.scheduled_cached_reqs]
        if sorted(named) != sorted(scheduled):
            raise self.error(
                "scheduled_new_reqs and scheduled_cached_reqs name exactly the scheduled requests",
                f"they name {sorted(named)}, num_scheduled_tokens has {sorted(scheduled)}",
            )
        for rid, computed in running_before.items():
            request = self.requests.get(rid)
            if (
                request is not None
                and not request.is_finished
                and rid not in output.preempted_req_ids
                and request.num_computed_tokens != computed
            ):
                raise self.error(
                    "schedule does not advance num_computed_tokens (update_after_schedule does)",
                    f"{rid}: num_computed_tokens {computed} -> {request.num_computed_tokens} "
                    f"during schedule",
                    rid,
                )

    def check_update_after_schedule(
        self, output: SchedulerOutput, after_schedule: Mapping[str, tuple[int, int]]
    ) -> None:
        """The `update_after_schedule` contract, after every plugin of the stack ran."""
        for rid, n in output.num_scheduled_tokens.items():
            request = self.requests[rid]
            computed, in_flight = after_schedule[rid]
            if request.num_computed_tokens != computed + n:
                raise self.error(
                    "update_after_schedule adds num_scheduled_tokens to num_computed_tokens",
                    f"{rid}: {computed} + {n} scheduled -> {request.num_computed_tokens}",
                    rid,
                )
            if request.num_in_flight_tokens != in_flight + n:
                raise self.error(
                    "update_after_schedule adds num_scheduled_tokens to num_in_flight_tokens",
                    f"{rid}: {in_flight} + {n} scheduled -> {request.num_in_flight_tokens}",
                    rid,
                )

    def check_after_step(self) -> None:
        """Ledger, placeholder and KV rules after a step, and the idle state when idle."""
        state = self.state()
        idle = not self.engine.has_work()
        try:
            check_invariants(state, self.step, idle=False)
        except InvariantViolation as exc:
            raise self.from_violation(exc) from exc
        for rid, request in state.requests.items():
            if self.mode == "sync" and request.num_output_placeholders != 0:
                raise self.error(
                    "no output placeholders under sync scheduling",
                    f"{rid} has {request.num_output_placeholders} placeholders",
                    rid,
                )
            if request.num_output_placeholders > request.num_in_flight_tokens:
                raise self.error(
                    "num_output_placeholders <= num_in_flight_tokens (a step's placeholders "
                    "are resolved when its result is processed)",
                    f"{rid} has {request.num_output_placeholders} placeholders but only "
                    f"{request.num_in_flight_tokens} tokens in flight",
                    rid,
                )
        kv = state.kv_cache_manager
        for rid, blocks in kv.req_to_blocks.items():
            live = state.requests.get(rid)
            if blocks and (live is None or live.is_finished):
                raise self.error(
                    "KV blocks are held only by live requests (finishing or aborting a "
                    "request frees its blocks through the fence)",
                    f"{rid} holds blocks {[b.block_id for b in blocks]} but is no live "
                    f"request of the scheduler",
                    rid,
                )
        if self.workload.enforce_wait_bound:
            self.check_waits()
        self.check_finish_by()
        if idle:
            self.check_idle(state)

    def check_waits(self) -> None:
        for rid, bound in self.wait_bounds.items():
            if rid in self.first_scheduled or self.finish.get(rid) is not None:
                continue
            waited = self.step - self.arrival[rid]
            if waited > bound:
                raise self.error(
                    "bounded wait: first scheduled within ceil(N * P / (B - S + 1)) + "
                    "floor(N * (M + a) / S) steps of arrival",
                    f"{rid} not scheduled in the {waited} steps since it arrived (after "
                    f"step {self.arrival[rid]}); bound {bound}",
                    rid,
                )

    def check_preemption_bound(self, preempted: set[str]) -> None:
        """The starvation rule: no request is preempted more than the workload's
        `max_preemptions_per_request` times."""
        bound = self.workload.max_preemptions_per_request
        for rid in preempted:
            count = self.preempted_counts[rid] = self.preempted_counts.get(rid, 0) + 1
            if bound is not None and count > bound:
                later = [
                    other
                    for other, reason in self.finish.items()
                    if reason is not None and self.arrival[other] > self.arrival[rid]
                ]
                raise self.error(
                    f"starvation bound: no request is preempted more than {bound} times",
                    f"{rid} was preempted {count} times in the {self.step - self.arrival[rid]} "
                    f"steps since it arrived, while {len(later)} requests that arrived after "
                    f"it finished: the victim rule keeps choosing it, so under a steady "
                    f"stream it is recomputed without end. A victim rule needs a starvation "
                    f"bound, e.g. never choose a request preempted k times while a candidate "
                    f"preempted fewer times runs (examples/tandem-lrw)",
                    rid,
                )

    def check_finish_by(self) -> None:
        """Requests with a `finish_by` step have finished by then."""
        for rid, spec in self.specs.items():
            due = spec.finish_by
            if due is None or self.step <= due or self.finish.get(rid) is not None:
                continue
            raise self.error(
                "a request that is preempted repeatedly still finishes within its bound",
                f"{rid} (arrived after step {spec.arrival}, {len(spec.prompt)} prompt tokens, "
                f"max_tokens {spec.max_tokens}) has not finished after step {due}; it was "
                f"preempted {self.preempted_counts.get(rid, 0)} times",
                rid,
            )

    def check_idle(self, state: SchedulerState) -> None:
        if state.requests or state.waiting or state.running:
            rid = next(iter(state.requests), None)
            raise self.error(
                "an idle scheduler holds no requests",
                f"registry {sorted(state.requests)}, {len(state.waiting)} WAITING, "
                f"{len(state.running)} RUNNING",
                rid,
            )
        kv = state.kv_cache_manager
        if not kv.all_blocks_free():
            holders = {rid: len(b) for rid, b in kv.req_to_blocks.items() if b}
            raise self.error(
                "every KV block is free when the engine is idle",
                f"{kv.num_free_blocks} of {kv.num_blocks} blocks free, "
                f"{kv.num_fenced_blocks} waiting for a fence, held by {holders}",
                next(iter(holders), None),
            )

    def check_not_blocked(self) -> None:
        """Each request waiting for its grammar let a request added after it run first."""
        requests = self.workload.requests
        for i, spec in enumerate(requests):
            if spec.ready_at is None:
                continue
            behind = [  # added after it (same step: later in the list), needing no grammar
                other.rid
                for j, other in enumerate(requests)
                if other.ready_at is None
                and (other.arrival, j) > (spec.arrival, i)
                and other.arrival < spec.ready_at
            ]
            if behind and not any(
                self.first_scheduled.get(rid, 1 << 30) <= spec.ready_at for rid in behind
            ):
                raise self.error(
                    "a request waiting for its grammar does not block the requests behind it",
                    f"{spec.rid} waited for its grammar until step {spec.ready_at}; none of "
                    f"{behind} was scheduled before then",
                    spec.rid,
                )

    def check_end(self) -> None:
        self.check_not_blocked()
        if self.engine.batch_queue:
            raise self.error(
                "no step is left in flight when idle",
                f"{len(self.engine.batch_queue)} steps queued",
            )
        self.check_idle(self.state())
        for spec in self.workload.requests:
            rid = spec.rid
            tokens, reason = self.tokens[rid], self.finish[rid]
            if reason is None:
                raise self.error("every request finishes", f"{rid} never finished", rid)
            expected = self.expected(spec)
            if expected is None:
                continue
            want_tokens, want_reason = expected
            if spec.aborted and want_reason == "abort":
                # A seeded request the reference run aborted too: only a common prefix
                # is known.
                common = min(len(tokens), len(want_tokens))
                if tokens[:common] != want_tokens[:common]:
                    raise self.error(
                        "seeded outputs equal the reference (a scheduler may change timing, "
                        "never tokens)",
                        f"{rid}: got {tokens} ({reason}), the reference run gave "
                        f"{want_tokens} (abort)",
                        rid,
                    )
            elif spec.aborted and reason == "abort":
                if len(tokens) >= len(want_tokens) or tokens != want_tokens[: len(tokens)]:
                    raise self.error(
                        "an aborted request's tokens are a strict prefix of its exact output",
                        f"{rid}: got {tokens}, exact output {want_tokens} ({want_reason})",
                        rid,
                    )
            elif (tokens, reason) != (want_tokens, want_reason):
                diverge = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(tokens, want_tokens, strict=False))
                        if a != b
                    ),
                    min(len(tokens), len(want_tokens)),
                )
                kind = "greedy" if spec.greedy else "seeded"
                raise self.error(
                    f"{kind} outputs equal the reference (a scheduler may change timing, "
                    f"never tokens)",
                    f"{rid}: got {tokens} ({reason}), want {want_tokens} ({want_reason}); "
                    f"first difference at output {diverge}",
                    rid,
                )

    def expected(self, spec: RequestSpec) -> tuple[list[int], str | None] | None:
        if self.kind == "diffusion":  # seeded too: the committed canvases ignore the draws
            params = spec.make().sampling_params
            return expected_scripted_diffusion_output(list(spec.prompt), params, self.engine.config)
        if spec.greedy:
            params = spec.make().sampling_params
            max_model_len = self.engine.max_model_len
            return expected_scripted_output(list(spec.prompt), params, VOCAB, EOS, max_model_len)
        if self.seeded_expected is None:
            return None
        return self.seeded_expected[spec.rid]
