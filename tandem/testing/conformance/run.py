"""Running one workload on one engine, step by step, checking every rule (`rules.py`)."""

from __future__ import annotations

import re
import traceback
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.core import hookimpl
from tandem.core.engine_core import EngineCore
from tandem.core.outputs import EngineCoreOutput
from tandem.core.request import Request
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.scheduler_state import SchedulerState
from tandem.plugin_discovery import load_plugin_class
from tandem.plugins.invariant_checker import InvariantViolation
from tandem.schema.config import ConfigError
from tandem.testing.conformance.kinds import (
    Kind,
    adapt_workload,
    model_overrides,
    sampler_for,
    scheduler_kind,
)
from tandem.testing.conformance.report import ConformanceError
from tandem.testing.conformance.rules import DriverRules
from tandem.testing.conformance.scenarios import CHECK_LIST
from tandem.testing.conformance.stack import StackUnderTest
from tandem.testing.conformance.workloads import (
    EOS,
    REFERENCE_SCHEDULER,
    VOCAB,
    Mode,
    Outputs,
    RequestSpec,
    Workload,
    check_wait_bound_regime,
    wait_bound,
)
from tandem.testing.engine import scripted_config


@dataclass
class RunResult:
    """What one workload run produced: per request the tokens and the finish reason, the
    steps taken, preemptions seen in `SchedulerOutput.preempted_req_ids`, the steps at
    which the engine was idle before the workload's last event, requests that
    ended with "abort" (and of those, the ones that had been scheduled), and per request
    the steps it waited before it was first scheduled and its `wait_bound` (when
    enforced)."""

    outputs: Outputs
    steps: int
    preemptions: int
    idle_points: int
    aborted: int
    aborted_after_scheduling: int
    waits: dict[str, int]
    wait_bounds: dict[str, int]

    @property
    def max_wait_ratio(self) -> float:
        """The largest wait / bound over the requests with a bound (0 when none)."""
        ratios = [self.waits[r] / max(b, 1) for r, b in self.wait_bounds.items() if r in self.waits]
        return max(ratios, default=0.0)


def stack_for(
    plugin: str | StackUnderTest, options: Mapping[str, Any] | None = None, mode: Mode = "sync"
) -> list[dict[str, Any]]:
    """The stack a conformance engine runs: the plugin as scheduler, then the sampler of
    its kind (`default-sampler`; `diffusion-sampler` for a diffusion scheduler; the async
    layer is inserted by the plugin manager when async is on). A policy plugin (one
    without the scheduler role: a WAITING order, a victim or a readiness seam) runs
    stacked after `reference-scheduler`. A `StackUnderTest` runs as its file lists it
    (`StackUnderTest.plugins(mode)`; its options were merged when it was loaded)."""
    if isinstance(plugin, StackUnderTest):
        return plugin.plugins(mode)
    entry = {"name": plugin, "options": dict(options or {})}
    sampler = {"name": sampler_for(scheduler_kind(plugin))}
    try:
        role = getattr(load_plugin_class(plugin), "role", None)
    except ConfigError:
        role = "scheduler"  # the engine start reports it
    if role == "scheduler":
        return [entry, sampler]
    return [{"name": "reference-scheduler"}, entry, sampler]


class _Probe:
    """Registered on a conformance engine's plugin manager after the stack loaded: checks
    the `schedule` and `update_after_schedule` contracts around the plugin's calls and
    queues the workload's in-flight aborts."""

    def __init__(self, driver: _Driver) -> None:
        self.driver = driver
        self.after_schedule: dict[str, tuple[int, int]] = {}

    @hookimpl(wrapper=True)
    def schedule(self) -> Generator[None, SchedulerOutput, SchedulerOutput]:
        driver = self.driver
        state = driver.state()
        running_before = {r.request_id: r.num_computed_tokens for r in state.running}
        output = yield
        driver.check_schedule(output, running_before)
        self.after_schedule = {
            rid: (
                driver.requests[rid].num_computed_tokens,
                driver.requests[rid].num_in_flight_tokens,
            )
            for rid in output.num_scheduled_tokens
        }
        return output

    @hookimpl(trylast=True)
    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        self.driver.check_update_after_schedule(scheduler_output, self.after_schedule)
        self.driver.queue_in_flight_aborts()

    @hookimpl
    def requests_not_ready(self) -> set[str]:
        """The workload's requests still waiting for their grammar in the step being
        planned (`driver.step`): ready after step `ready_at`."""
        driver = self.driver
        return {
            rid
            for rid in driver.requests
            if (ready_at := driver.specs[rid].ready_at) is not None and driver.step <= ready_at
        }


_VIOLATION = re.compile(r"^(?:KV: )?(?P<inv>.+?) violated(?: by (?P<rid>[^\s:]+))?")

_KV_REQUEST = re.compile(r"request (?P<rid>[^\s:,]+)")


class _Driver(DriverRules):
    """Runs one workload on one engine, step by step, checking every rule."""

    def __init__(
        self,
        plugin: str | StackUnderTest,
        options: Mapping[str, Any] | None,
        workload: Workload,
        mode: Mode,
        check: str,
        seeded_expected: Outputs | None,
    ) -> None:
        self.plugin = plugin
        self.kind: Kind = scheduler_kind(plugin)
        self.workload = workload = adapt_workload(workload, self.kind)
        self.mode = mode
        self.check = check
        self.seeded_expected = seeded_expected
        self.step = 0
        self.requests: dict[str, Request] = {}
        self.specs = {s.rid: s for s in workload.requests}
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.arrival: dict[str, int] = {}
        self.first_scheduled: dict[str, int] = {}
        self.wait_bounds: dict[str, int] = {}
        self.preemptions = 0
        #: Per request, the steps that preempted it (`SchedulerOutput.preempted_req_ids`).
        self.preempted_counts: dict[str, int] = {}
        self.idle_points = 0
        if workload.enforce_wait_bound:
            check_wait_bound_regime(workload)
        try:
            config = scripted_config(
                vocab_size=VOCAB,
                eos_token_id=EOS,
                check_invariants=True,
                async_scheduling=mode == "async",
                plugins=stack_for(plugin, options, mode),
                **{**model_overrides(self.kind), **workload.limits},
            )
            self.engine = EngineCore(config)
        except Exception as exc:
            raise self.error("the stack loads and starts", f"{type(exc).__name__}: {exc}") from exc
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.engine.plugin_manager.register(_Probe(self), name="tandem-conformance-probe")

    def error(self, invariant: str, detail: str, request_id: str | None = None) -> ConformanceError:
        request = self.requests.get(request_id) if request_id is not None else None
        return ConformanceError(
            plugin=str(self.plugin),
            check=self.check,
            mode=self.mode,
            workload=self.workload.name,
            step=self.step,
            invariant=invariant,
            detail=detail,
            request_id=request_id,
            ledger=request.ledger() if request is not None else None,
        )

    def from_violation(self, exc: InvariantViolation) -> ConformanceError:
        """The kernel's invariant message, with the invariant and the request pulled out."""
        problems = str(exc).splitlines()[1:] or [str(exc)]
        first = problems[0]
        match = _VIOLATION.match(first)
        invariant = match.group("inv") if match else first.split(":")[0]
        rid = match.group("rid") if match else None
        if rid is None:
            kv_match = _KV_REQUEST.search(first)
            rid = kv_match.group("rid") if kv_match else None
        if first.startswith("KV: "):
            invariant = "KV: " + invariant
        known = rid if rid in self.requests else None
        if known is not None:  # its ledger is printed below the detail
            problems[0] = re.sub(r": \{.*\}$", "", first)
        return self.error(invariant, "\n    ".join(problems), known)

    def state(self) -> SchedulerState:
        state = self.engine.scheduler_state
        if not isinstance(state, SchedulerState):
            raise self.error(
                "the scheduler answers the scheduler_state hook",
                f"scheduler_state returned {state!r}",
            )
        return state

    def add(self, spec: RequestSpec) -> None:
        request = spec.make()
        num_ahead = sum(1 for rid in self.requests if self.finish.get(rid) is None)
        self.requests[spec.rid] = request
        self.tokens[spec.rid] = []
        self.finish[spec.rid] = None
        self.arrival[spec.rid] = self.step
        if self.workload.enforce_wait_bound:
            self.wait_bounds[spec.rid] = wait_bound(num_ahead, self.workload, self.mode == "async")
        try:
            self.engine.add_request(request)
        except Exception as exc:
            raise self.error(
                "add_request accepts a valid request", f"{type(exc).__name__}: {exc}", spec.rid
            ) from exc

    def queue_in_flight_aborts(self) -> None:
        ids = [s.rid for s in self.workload.requests if s.abort_in_flight_at == self.step - 1]
        if ids:
            self.engine.abort_requests(ids)

    def take_outputs(self, outputs: Sequence[EngineCoreOutput]) -> None:
        for out in outputs:
            rid = out.request_id
            if rid not in self.requests:
                raise self.error(
                    "outputs only for requests in the engine", f"output for unknown {rid}: {out}"
                )
            if self.finish[rid] is not None:
                raise self.error(
                    "no output after a request finished",
                    f"{rid} finished ({self.finish[rid]}) and then got {out}",
                    rid,
                )
            if out.finish_reason not in (None, "stop", "length", "abort"):
                raise self.error("finish reasons are stop, length or abort", f"{rid}: {out}", rid)
            self.tokens[rid].extend(out.new_token_ids)
            self.finish[rid] = out.finish_reason

    def run(self) -> RunResult:
        workload = self.workload
        last_event = workload.last_event()
        cap = workload.step_cap()
        try:
            while True:
                for spec in workload.requests:
                    if spec.arrival == self.step:
                        self.add(spec)
                    if spec.abort_at == self.step:
                        self.engine.abort_requests([spec.rid])
                if not self.engine.has_work():
                    self.check_idle(self.state())
                    if self.step >= last_event:
                        break
                    self.idle_points += 1
                    self.step += 1  # nothing to do until the next arrival
                    continue
                if self.step >= cap:
                    unfinished = [rid for rid, r in self.finish.items() if r is None]
                    raise self.error(
                        "every request finishes within the step cap",
                        f"{len(unfinished)} requests unfinished after {cap} steps: "
                        f"{unfinished[:8]}",
                        unfinished[0] if unfinished else None,
                    )
                self.step += 1
                try:
                    outputs, _ = self.engine.step_fn()
                except ConformanceError:
                    raise
                except InvariantViolation as exc:
                    raise self.from_violation(exc) from exc
                except Exception as exc:
                    frame = traceback.extract_tb(exc.__traceback__)[-1]
                    raise self.error(
                        "the engine step raises no exception",
                        f"{type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})",
                    ) from exc
                self.take_outputs(outputs)
                self.check_after_step()
            self.check_end()
        finally:
            self.engine.shutdown()
        aborted = [rid for rid, reason in self.finish.items() if reason == "abort"]
        return RunResult(
            outputs={rid: (self.tokens[rid], self.finish[rid]) for rid in self.requests},
            steps=self.step,
            preemptions=self.preemptions,
            idle_points=self.idle_points,
            aborted=len(aborted),
            aborted_after_scheduling=sum(1 for rid in aborted if rid in self.first_scheduled),
            waits={
                rid: self.first_scheduled[rid] - 1 - self.arrival[rid]
                for rid in self.requests
                if rid in self.first_scheduled
            },
            wait_bounds=dict(self.wait_bounds),
        )


def run_workload(
    plugin: str | StackUnderTest,
    workload: Workload,
    mode: Mode = "sync",
    options: Mapping[str, Any] | None = None,
    check: str = "workload",
    seeded_expected: Outputs | None = None,
) -> RunResult:
    """Run `workload` with `plugin` (an entry-point name, or a whole `StackUnderTest`) in `mode`,
    checking every per-step rule; raise `ConformanceError` (reported under `check`) on the
    first violation. Greedy requests are compared with `expected_scripted_output`, seeded
    ones with `seeded_expected` when given; under a diffusion scheduler (`kinds.py`) the
    workload is adapted and every request is compared with
    `expected_scripted_diffusion_output`."""
    return _Driver(plugin, options, workload, mode, check, seeded_expected).run()


_REFERENCE_CACHE: dict[tuple[int, str], Outputs] = {}


def reference_outputs(workload: Workload, mode: Mode = "sync") -> Outputs:
    """Per request, the tokens and finish reason of `workload` on the reference scheduler
    in `mode`: what any conforming scheduler must produce, seeded requests included. The
    built-in workloads' results are cached for the process."""
    builtin = any(workload is w for c in CHECK_LIST for w in c.workloads)
    key = (id(workload), mode)
    if builtin and key in _REFERENCE_CACHE:
        return _REFERENCE_CACHE[key]
    outputs = run_workload(REFERENCE_SCHEDULER, workload, mode, check="reference run").outputs
    if builtin:
        _REFERENCE_CACHE[key] = outputs
    return outputs
