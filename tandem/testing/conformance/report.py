"""Conformance results: the error naming the broken rule, and the report of a run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class ConformanceError(AssertionError):
    """A plugin broke a conformance rule.

    The message names the plugin, the check, the mode (sync/async), the workload, the step
    (the number of `EngineCore.step_fn` calls started; 0 = before the first step), the
    rule (`invariant`), the request and that request's ledger (`Request.ledger()`).
    """

    def __init__(
        self,
        *,
        plugin: str,
        check: str,
        mode: str,
        workload: str,
        step: int,
        invariant: str,
        detail: str,
        request_id: str | None = None,
        ledger: Mapping[str, object] | None = None,
    ) -> None:
        self.plugin = plugin
        self.check = check
        self.mode = mode
        self.workload = workload
        self.step = step
        self.invariant = invariant
        self.detail = detail
        self.request_id = request_id
        self.ledger = dict(ledger) if ledger is not None else None
        where = f"at step {step}" if step > 0 else "before the first step"
        lines = [
            f"tandem conformance: plugin {plugin!r} failed check {check!r} [{mode}] "
            f"(workload {workload!r}) {where}",
            f"  invariant: {invariant}",
            f"  detail: {detail}",
        ]
        if request_id is not None:
            lines.append(f"  request: {request_id}")
            lines.append(f"  ledger: {self.ledger if self.ledger is not None else 'unknown'}")
        super().__init__("\n".join(lines))


class CheckNotApplicable(Exception):
    """A check (or rule) that does not apply to the scheduler's kind; the message is the
    reason (`kinds.NOT_APPLICABLE`)."""


@dataclass
class CheckResult:
    """One (check, mode) of a conformance run: passed or the error, and run details
    (steps, preemptions, aborts, the largest wait/bound ratio, ...). `not_applicable` is
    the reason when the check does not apply to the scheduler's kind (not run; it counts
    as passed and is reported "N/A")."""

    check: str
    mode: str
    error: ConformanceError | None
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)
    not_applicable: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None


@dataclass
class ConformanceReport:
    """What `run_conformance` found: one `CheckResult` per (check, mode), in run order."""

    plugin: str
    results: list[CheckResult]
    #: The scheduler's kind (`kinds.scheduler_kind`) and, by name, every check or rule
    #: that does not apply to it, with the reason.
    kind: str = "autoregressive"
    not_applicable: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def applied(self) -> list[CheckResult]:
        """The results of the checks that ran (not n/a)."""
        return [r for r in self.results if r.not_applicable is None]

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def result(self, check: str, mode: str) -> CheckResult:
        """The result of `check` in `mode` (KeyError if it was not run)."""
        for r in self.results:
            if r.check == check and r.mode == mode:
                return r
        raise KeyError((check, mode))

    def raise_for_failures(self) -> None:
        """Raise the first failure's `ConformanceError` (the others are listed in it)."""
        failures = self.failures
        if not failures:
            return
        first = failures[0].error
        assert first is not None
        if len(failures) > 1:
            others = ", ".join(f"{r.check} [{r.mode}]" for r in failures[1:])
            first.args = (f"{first.args[0]}\n  also failed: {others}",)
        raise first

    def summary(self) -> str:
        """One line per (check, mode): PASS/FAIL/N/A, seconds, and the failed rule or the
        reason it does not apply; then one line per rule that does not apply."""
        lines = [f"tandem conformance of {self.plugin!r} ({self.kind} scheduler):"]
        checks = {r.check for r in self.results}
        for r in self.results:
            if r.not_applicable is not None:
                lines.append(f"  N/A  {r.check:<18} [{r.mode:<5}]  n/a: {r.not_applicable}")
                continue
            status = "PASS" if r.passed else "FAIL"
            why = f"  {r.error.invariant}" if r.error is not None else ""
            lines.append(f"  {status} {r.check:<18} [{r.mode:<5}] {r.seconds:6.2f}s{why}")
        for name, reason in self.not_applicable.items():
            if name not in checks:
                lines.append(f"  N/A  rule {name}: n/a: {reason}")
        return "\n".join(lines)
