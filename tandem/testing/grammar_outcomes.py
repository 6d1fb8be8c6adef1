"""What a grammar conformance request gave: its outcome, and the report of a run.

`classify` turns one `RequestOutput` of a `SchemaCase` into a `CaseResult` (`valid`,
`cut`, `refused`, `invalid`, `error`; see `grammar_conformance.py` for their meaning),
validating the text with `jsonschema` (`schema_errors`) and checking that a refusal names
a keyword the schema has at that JSON path (`refused_keyword`).
`GrammarConformanceReport` gathers the results of a run; `raise_for_failures` raises
`GrammarConformanceError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.testing.grammar_corpus import SchemaCase

Outcome = Literal["valid", "cut", "refused", "invalid", "error"]
#: Outcomes that fail a case.
FAILING: frozenset[str] = frozenset({"invalid", "error"})


@dataclass
class CaseResult:
    """What one request of the corpus gave."""

    backend: str
    mode: str
    case: str
    outcome: Outcome
    detail: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.outcome in FAILING

    def line(self) -> str:
        status = "FAIL" if self.failed else "ok  "
        return f"  {status} {self.case:<24} [{self.mode:<5}] {self.outcome:<8} {self.detail}"


class GrammarConformanceError(AssertionError):
    """A grammar backend let an output violate its schema, or failed otherwise."""


@dataclass
class GrammarConformanceReport:
    """Every `CaseResult` of a run, in (backend, mode, case) order."""

    backends: list[str]
    results: list[CaseResult]

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.failed]

    @property
    def passed(self) -> bool:
        return not self.failures

    def result(self, backend: str, case: str, mode: str) -> CaseResult:
        for r in self.results:
            if (r.backend, r.case, r.mode) == (backend, case, mode):
                return r
        raise KeyError((backend, case, mode))

    def counts(self, backend: str) -> dict[str, int]:
        """Outcome -> number of results of `backend`."""
        out: dict[str, int] = {}
        for r in self.results:
            if r.backend == backend:
                out[r.outcome] = out.get(r.outcome, 0) + 1
        return out

    def summary(self) -> str:
        lines = []
        for backend in self.backends:
            counts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts(backend).items()))
            lines.append(f"tandem grammar conformance of {backend!r}: {counts}")
            lines.extend(r.line() for r in self.results if r.backend == backend)
        return "\n".join(lines)

    def raise_for_failures(self) -> None:
        if self.failures:
            lines = [f"{len(self.failures)} grammar conformance failure(s):"]
            lines.extend(f"{r.backend}: {r.line().strip()}" for r in self.failures)
            raise GrammarConformanceError("\n".join(lines))


# Classification -------------------------------------------------------------------------

_REFUSED_KEYWORD = re.compile(r"(\$(?:\.[A-Za-z_$][\w$-]*|\[[^\]]*\])*)\.([A-Za-z$]+): ")


def _resolve(schema: Any, path: str) -> Any:
    """The subschema at a JSON path `$.a.b[0]["c d"]` (None when it does not exist)."""
    node = schema
    for name, index, quoted in re.findall(
        r"\.([A-Za-z_$][\w$-]*)|\[(\d+)\]|\[(\"[^\]]*\")\]", path[1:]
    ):
        key: Any = int(index) if index else (json.loads(quoted) if quoted else name)
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def refused_keyword(schema: Mapping[str, Any], error: str) -> str | None:
    """`path.keyword` when `error` names a keyword the schema has at that path."""
    for path, keyword in _REFUSED_KEYWORD.findall(error):
        node = _resolve(schema, path)
        if isinstance(node, dict) and keyword in node:
            return f"{path}.{keyword}"
    return None


def schema_errors(schema: Mapping[str, Any], text: str) -> list[str]:
    """Why `text` is not a JSON document valid under `schema` (empty when it is)."""
    try:
        import jsonschema
    except ImportError:
        raise GrammarConformanceError(
            "the grammar conformance check validates with the jsonschema library: "
            "pip install jsonschema (or tandem[test])"
        ) from None

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return [f"not JSON: {exc}"]
    validator_cls = jsonschema.validators.validator_for(
        schema, default=jsonschema.Draft202012Validator
    )
    return [
        f"{'/'.join(str(p) for p in e.absolute_path) or '$'}: {e.message}"
        for e in validator_cls(schema).iter_errors(value)
    ]


def classify(case: SchemaCase, output: Any, backend: str, mode: str) -> CaseResult:
    """The `CaseResult` of one `RequestOutput` of `case`."""
    completion = output.outputs[0]
    text, tokens = completion.text, list(completion.token_ids)
    reason = completion.finish_reason
    if reason == "stop":
        errors = schema_errors(case.schema, text)
        if errors:
            return CaseResult(backend, mode, case.name, "invalid", "; ".join(errors), text, tokens)
        return CaseResult(backend, mode, case.name, "valid", text, text, tokens)
    if reason == "length":
        return CaseResult(
            backend, mode, case.name, "cut", f"cut at max_tokens: {text}", text, tokens
        )
    error = output.error or f"finish_reason {reason!r} without an error message"
    keyword = refused_keyword(case.schema, error) if reason == "error" and not tokens else None
    if keyword is None:
        return CaseResult(backend, mode, case.name, "error", error, text, tokens)
    if case.must_enforce:
        return CaseResult(backend, mode, case.name, "error", f"refused a plain schema: {error}")
    return CaseResult(backend, mode, case.name, "refused", error)
