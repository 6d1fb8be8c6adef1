"""What the KV-connector conformance check reports: `KVConnectorConformanceError` (a broken
rule), `KVCheckResult` (one check in one mode) and `KVConnectorReport` (every result)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class KVConnectorConformanceError(AssertionError):
    """A connector broke a rule: names the connector, the check, the mode, the rule and
    what was seen."""

    def __init__(self, *, connector: str, check: str, mode: str, rule: str, detail: str) -> None:
        self.connector, self.check, self.mode = connector, check, mode
        self.rule, self.detail = rule, detail
        super().__init__(
            f"tandem KV-connector conformance: {connector!r} failed check {check!r} [{mode}]\n"
            f"  rule: {rule}\n  detail: {detail}"
        )


class _Violation(Exception):
    """Raised inside a check: (rule, detail), made a `KVConnectorConformanceError`."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(rule, detail)
        self.rule, self.detail = rule, detail


@dataclass
class KVCheckResult:
    """One (check, mode): the error (None: passed), seconds taken, run details."""

    check: str
    mode: str
    error: KVConnectorConformanceError | None
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.error is None


@dataclass
class KVConnectorReport:
    """What `run_kv_connector_conformance` found: one result per (check, mode), in order."""

    connector: str
    results: list[KVCheckResult]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failures(self) -> list[KVCheckResult]:
        return [r for r in self.results if not r.passed]

    def result(self, check: str, mode: str) -> KVCheckResult:
        """The result of `check` in `mode` (KeyError if it was not run)."""
        for r in self.results:
            if r.check == check and r.mode == mode:
                return r
        raise KeyError((check, mode))

    def raise_for_failures(self) -> None:
        """Raise the first failure's `KVConnectorConformanceError`, naming the others."""
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
        """One line per (check, mode): PASS/FAIL, seconds, the broken rule."""
        lines = [f"tandem KV-connector conformance of {self.connector!r}:"]
        for r in self.results:
            status = "PASS" if r.passed else "FAIL"
            why = f"  {r.error.rule}" if r.error is not None else ""
            lines.append(f"  {status} {r.check:<16} [{r.mode:<5}] {r.seconds:6.2f}s{why}")
        return "\n".join(lines)
