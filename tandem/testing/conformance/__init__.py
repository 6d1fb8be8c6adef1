"""Plugin conformance suite: does a scheduler plugin behave like the reference scheduler?

A scheduler plugin may change *when* tokens are computed, never *which* tokens come out,
and it must keep the request ledger, the KV cache and the scheduling rules of the hook
contract (`tandem.core.hookspecs`). This package runs fixed, seeded workloads on the
scripted model with the plugin in the scheduler role and checks all of that, under
synchronous (`async_scheduling: false`, `EngineCore.step`) and asynchronous
(`async_scheduling: true`, `EngineCore.step_with_batch_queue`) scheduling.

Use from Python::

    from tandem.testing.conformance import run_conformance

    report = run_conformance("my-scheduler", {"some_option": 1})
    print(report.summary())
    report.raise_for_failures()        # ConformanceError naming the first failure

or from pytest, in any directory (even an empty one), one item per (check, mode)::

    python -m pytest -p tandem --tandem-conformance my-scheduler \
        [--tandem-conformance-options 'my-scheduler={"some_option": 1}']

A whole stack file is a unit under test too (`stack.py`): its `plugins:` list, in order,
with its options (`run_stack_conformance(path, {name: options})`, or
`--tandem-conformance-stack stack.yaml`, with `--tandem-conformance-options NAME=JSON`
merged over the file's options of the entry NAME).

The plugin is found by name, exactly as a stack file names it (an entry point of
`tandem.plugins`, a name registered in-process, or `module:Class`): each engine runs the stack `[{"name": NAME, "options": OPTIONS},
{"name": "default-sampler"}]` (plus `async-scheduler`, which the plugin manager inserts
right after the scheduler when async scheduling is on), on the in-process executor.
Tests may also pass a plugin *class*: it is registered by class (the kernel's in-process
registry, `register_plugin`) under `test-<kebab-case class name>` for the run, and
`registered_plugins({name: cls})` registers classes under chosen names; no distribution is
written anywhere.

The scheduler's kind (`kinds.py`) picks the model: a scheduler with
`num_sampled_tokens_per_step == 0` (e.g. `diffusion-scheduler`) runs on `scripted-diffusion`
with `diffusion-sampler`, its workloads adapted (no `min_tokens`, stop tokens from its own
stream, a budget of at least one canvas) and every output held to
`expected_scripted_diffusion_output`. What does not apply to a kind
(`NOT_APPLICABLE`, with the reason) is reported, never skipped silently: an "N/A" line per
check and rule in `ConformanceReport.summary()`, a skip "n/a: <reason>" under pytest.

Checks (`CHECKS`), each run in both modes (`MODES`):

- `greedy-parity` (a): greedy outputs equal `expected_scripted_output`, and seeded
  (temperature 0.8) outputs equal the reference scheduler's run of the same workload.
- `ledger-invariants` (b): stress workloads (tiny token budgets, chunked prefill, KV pools
  of one sequence, prefix sharing) whose point is the per-step checks below.
- `kv-no-leak` (c): two waves of requests separated by an idle gap; every KV block is free
  whenever the engine is idle, and no block is ever held by a finished request.
- `all-finish` (d): edge cases (the `max_model_len` cap, `max_tokens=1`, one-token prompts,
  `min_tokens`, stop on the first token, identical prompts) all finish with the right
  reason within the step cap `Workload.step_cap()`.
- `bounded-wait` (e): under steady arrivals no request waits longer than `wait_bound`
  steps to be first scheduled (see "The waiting bound" below).
- `abort` (f): aborts of WAITING, prefilling, decoding and preempted requests, queued
  between steps and while a step is in flight (under async: while two are), and of a
  request that already finished: aborted requests end with finish reason "abort" and a
  strict prefix of their exact tokens, all others are exact, nothing leaks.
- `preemption` (f): KV pools the size of one max-length sequence force preemption by
  recompute; outputs stay exact and nothing leaks.
- `victim-starvation` (h): a long request beside a steady stream of short ones on a KV
  pool of one max-length sequence, so it is preempted again and again: no request is
  preempted more than `PREEMPTION_BOUND` times (a victim rule with no starvation bound
  keeps choosing the long request; the error says so), and the long request finishes
  within twice the steps it needs alone plus 16 (`RequestSpec.finish_by`).
- `grammar-ready` (g): requests a plugin reports in `requests_not_ready` for a number of
  steps (a grammar compiling) are never scheduled before they are ready, the requests
  added behind them are scheduled meanwhile (waiting for a grammar blocks no one), and
  every request still finishes with exact outputs.

Per step, every check verifies (a violation raises `ConformanceError` naming the rule):

- the ledger and KV invariants (`tandem.plugins.invariant_checker.check_invariants`; the
  engines run with `check_invariants: true`, so its plugin also checks after every
  `update_from_output` and raises `InvariantViolation`, which is reported here with the
  invariant, the step, the request and its ledger);
- placeholder accounting: no output placeholders under sync scheduling; under async,
  `num_output_placeholders <= num_in_flight_tokens` (a placeholder stands for a sampled
  token whose step is still in flight, so resolving a step's result must remove them);
- KV blocks are held only by live (unfinished, registered) requests;
- the `schedule` contract: only live requests are scheduled, each with `0 <
  num_scheduled_tokens <= num_tokens_with_spec + num_output_placeholders -
  num_computed_tokens`; totals add up and respect `max_num_batched_tokens`; at most
  `max_num_seqs` requests RUNNING; new and cached request data name exactly the scheduled
  requests; no WAITING request is admitted in a step that preempted; `schedule` does not
  advance `num_computed_tokens` of running requests;
- the `update_after_schedule` contract: `num_computed_tokens` and `num_in_flight_tokens`
  grow by exactly `num_scheduled_tokens`;
- outputs: only for requests in the engine, nothing after a request finished.

At the end of every run: the engine is idle, the scheduler holds no requests, every KV
block is free, every request finished, and outputs are exact.

Layout: `workloads.py` (requests, workloads, the waiting bound and its derivation, the
starvation bound), `scenarios.py` (the checks and their workloads), `rules.py` (the
per-step and end-of-run rules), `run.py` (driving one engine through a workload),
`stack.py` (a stack file as the unit under test), `report.py` (errors and reports),
`ledger.py` (ledger traces); this module registers plugins and runs checks.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tandem.plugin_discovery import discover_plugins, register_plugin, unregister_plugin
from tandem.testing.conformance.kinds import (
    DIFFUSION_CANVAS,
    NOT_APPLICABLE,
    Kind,
    adapt_workload,
    not_applicable,
    scheduler_kind,
)
from tandem.testing.conformance.ledger import LedgerStep, format_ledger_trace, ledger_trace
from tandem.testing.conformance.report import (
    CheckNotApplicable,
    CheckResult,
    ConformanceError,
    ConformanceReport,
)
from tandem.testing.conformance.run import RunResult, reference_outputs, run_workload, stack_for
from tandem.testing.conformance.scenarios import _CHECKS_BY_NAME, CHECK_LIST, CHECKS, Check
from tandem.testing.conformance.stack import StackUnderTest, load_stack
from tandem.testing.conformance.workloads import (
    EOS,
    MODES,
    PREEMPTION_BOUND,
    REFERENCE_SCHEDULER,
    SEEDED_TEMPERATURE,
    VOCAB,
    Mode,
    Outputs,
    RequestSpec,
    Workload,
    check_wait_bound_regime,
    wait_bound,
)

__all__ = [
    "CHECKS",
    "CHECK_LIST",
    "DIFFUSION_CANVAS",
    "EOS",
    "MODES",
    "NOT_APPLICABLE",
    "PREEMPTION_BOUND",
    "REFERENCE_SCHEDULER",
    "SEEDED_TEMPERATURE",
    "VOCAB",
    "Check",
    "CheckNotApplicable",
    "CheckResult",
    "ConformanceError",
    "ConformanceReport",
    "Kind",
    "LedgerStep",
    "Mode",
    "Outputs",
    "RequestSpec",
    "RunResult",
    "StackUnderTest",
    "Workload",
    "adapt_workload",
    "check_conformance",
    "check_wait_bound_regime",
    "format_ledger_trace",
    "ledger_trace",
    "load_stack",
    "not_applicable",
    "reference_outputs",
    "registered_plugins",
    "run_conformance",
    "run_stack_conformance",
    "run_workload",
    "scheduler_kind",
    "stack_for",
    "wait_bound",
]


def _kebab(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()


@contextlib.contextmanager
def registered_plugins(plugins: Mapping[str, type]) -> Iterator[None]:
    """Make plugin classes resolvable by name for the block (the kernel's in-process
    registry, `tandem.plugin_discovery.register_plugin`). Names of installed plugins
    are refused (ValueError). A worker in another process imports a class by its path, so
    a class defined in a function runs with the in-process or thread executor only."""
    clash = sorted(set(plugins) & set(discover_plugins()))
    if clash:
        raise ValueError(f"plugin names already installed: {clash}")
    for name, cls in plugins.items():
        register_plugin(name, cls)
    try:
        yield
    finally:
        for name in plugins:
            unregister_plugin(name)


@contextlib.contextmanager
def _plugin_name(plugin: str | type | StackUnderTest) -> Iterator[str | StackUnderTest]:
    """What to run: `plugin` itself (a name or a stack), or a class registered for the
    block under `test-<kebab-case class name>`."""
    if isinstance(plugin, (str, StackUnderTest)):
        yield plugin
        return
    name = f"test-{_kebab(plugin.__name__)}"
    with registered_plugins({name: plugin}):
        yield name


def check_conformance(
    plugin: str | type | StackUnderTest,
    check: str,
    mode: Mode,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one check in one mode; raise `ConformanceError` on a violation and
    `CheckNotApplicable` (the reason) when the check does not apply to the plugin's kind,
    else return the run's details (steps, preemptions, aborts, the largest wait/bound
    ratio)."""
    if check not in _CHECKS_BY_NAME:
        raise ValueError(f"unknown check {check!r}; checks: {', '.join(CHECKS)}")
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    details: dict[str, Any] = {
        "steps": 0,
        "preemptions": 0,
        "idle_points": 0,
        "aborted": 0,
        "aborted_after_scheduling": 0,
        "max_wait_ratio": 0.0,
    }
    with _plugin_name(plugin) as name:
        kind = scheduler_kind(name)
        reason = not_applicable(kind, check)
        if reason is not None:
            raise CheckNotApplicable(reason)
        for workload in _CHECKS_BY_NAME[check].workloads:
            seeded = None
            if kind == "autoregressive" and any(not s.greedy for s in workload.requests):
                seeded = reference_outputs(workload, mode)
            result = run_workload(name, workload, mode, options, check, seeded)
            details["steps"] += result.steps
            details["preemptions"] += result.preemptions
            details["idle_points"] += result.idle_points
            details["aborted"] += result.aborted
            details["aborted_after_scheduling"] += result.aborted_after_scheduling
            details["max_wait_ratio"] = max(details["max_wait_ratio"], result.max_wait_ratio)
    return details


def run_conformance(
    plugin: str | type | StackUnderTest,
    options: Mapping[str, Any] | None = None,
    checks: Sequence[str] | None = None,
    modes: Sequence[Mode] = MODES,
) -> ConformanceReport:
    """Run every check (or `checks`) in every mode (or `modes`) on the scheduler plugin
    named `plugin` (an entry point of `tandem.plugins`) with `options`; never raises for a
    failed check: see `ConformanceReport.passed` / `raise_for_failures()`.

    `plugin` may also be a plugin class (for tests): it is registered by class under
    `test-<kebab-case class name>` for the run. The report lists what does not apply to
    the plugin's kind (`kinds.py`): checks as "N/A" results, rules by name.
    """
    selected = list(checks) if checks is not None else list(CHECKS)
    results: list[CheckResult] = []
    with _plugin_name(plugin) as name:
        kind = scheduler_kind(name)
        for check in selected:
            for mode in modes:
                results.append(_run_one(name, check, mode, options))
    return ConformanceReport(str(name), results, kind, dict(NOT_APPLICABLE[kind]))


def run_stack_conformance(
    path: str,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    checks: Sequence[str] | None = None,
    modes: Sequence[Mode] = MODES,
) -> ConformanceReport:
    """`run_conformance` on a whole stack file: its plugin list, in order, with each
    entry's options merged under `options[name]` (`stack.load_stack`)."""
    return run_conformance(load_stack(path, options), checks=checks, modes=modes)


def _run_one(
    name: str | StackUnderTest, check: str, mode: Mode, options: Mapping[str, Any] | None
) -> CheckResult:
    start = time.perf_counter()
    try:
        details = check_conformance(name, check, mode, options)
    except ConformanceError as exc:
        return CheckResult(check, mode, exc, time.perf_counter() - start)
    except CheckNotApplicable as exc:
        return CheckResult(check, mode, None, 0.0, not_applicable=str(exc))
    return CheckResult(check, mode, None, time.perf_counter() - start, details)
