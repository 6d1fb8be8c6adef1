"""Grammar-backend conformance: does a backend's constrained output satisfy its schema?

A grammar backend may refuse a JSON schema it cannot enforce, but it must never accept
one and then let the model write a value the schema forbids. This module runs a corpus of
JSON schemas (numeric bounds on integers and floats, exclusive bounds, string lengths,
patterns, a pattern beside lengths, enums, constants, nested arrays with item counts,
nested and optional objects, `oneOf`, `allOf`, `$ref` recursion, and keywords no bundled
backend enforces) through a real model (the embedded SmolLM2 by default), greedy, under
synchronous and asynchronous scheduling, and classifies every request:

- `valid`: finished with "stop", parses as JSON and validates with `jsonschema` (the
  reference implementation; the validator class follows the schema's `$schema`);
- `cut`: finished with "length" (max_tokens): reported, not a failure;
- `refused`: ended with "error" at `add_request`, naming the keyword it refused by its
  JSON path (`... $.properties.age.maximum: ...`, a keyword the schema has there); a
  failure only for the cases marked `must_enforce` (plain shapes every backend handles);
- `invalid` (failure): finished with "stop" but the text is not valid JSON or violates
  the schema;
- `error` (failure): any other error (a compile failure, a refusal that names no keyword
  of the schema);
- and, when both modes ran, async output that differs from sync token for token (greedy
  decoding must not depend on scheduling) is a failure of the async result.

Use from Python::

    from tandem.testing.grammar_conformance import run_grammar_conformance

    report = run_grammar_conformance("outlines")     # or "xgrammar", "auto"
    print(report.summary())
    report.raise_for_failures()                      # GrammarConformanceError

or from pytest, in any directory, one item per (case, mode)::

    python -m pytest -p tandem --tandem-grammar-conformance outlines \\
        [--tandem-grammar-conformance-corpus full]

`BACKEND` is a backend of the bundled `structured-output` plugin (`xgrammar`,
`outlines`, `auto`; several run in one engine per mode) or the entry-point name of a
third-party grammar plugin (stack: reference scheduler, default sampler, that plugin).
`CI_CORPUS` (8 schemas) runs in about a minute for both bundled backends on two cores;
`CORPUS` is the full set.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["sync", "async"]
MODES: tuple[Mode, ...] = ("sync", "async")
#: Backends of the bundled `structured-output` plugin.
BUNDLED_BACKENDS = ("xgrammar", "outlines", "auto")
Outcome = Literal["valid", "cut", "refused", "invalid", "error"]
#: Outcomes that fail a case.
FAILING: frozenset[str] = frozenset({"invalid", "error"})
DEFAULT_MAX_TOKENS = 48


@dataclass(frozen=True)
class SchemaCase:
    """One constrained request: a prompt (often one that tempts the model to break the
    schema) and the JSON schema its output must satisfy."""

    name: str
    prompt: str
    schema: dict[str, Any]
    #: Plain shapes every grammar backend must enforce (a refusal is a failure).
    must_enforce: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS


def _obj(required: Sequence[str] | None = None, **properties: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    schema["required"] = list(properties) if required is None else list(required)
    return schema


_DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
CORPUS: tuple[SchemaCase, ...] = (
    SchemaCase(
        "plain-shapes",
        "Describe a city (name, population, coastal) as JSON.",
        _obj(name={"type": "string"}, population={"type": "integer"}, coastal={"type": "boolean"}),
        must_enforce=True,
    ),
    SchemaCase(
        "int-bounds",
        "How old is the universe, in years? Answer as JSON with a name and an age.",
        _obj(
            name={"type": "string", "maxLength": 12},
            age={"type": "integer", "minimum": 0, "maximum": 99},
        ),
    ),
    SchemaCase(
        "int-exclusive-and-large",
        "Give the population of Tokyo and a score as JSON.",
        _obj(
            population={"type": "integer", "minimum": 100000, "maximum": 999999},
            score={"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        ),
    ),
    SchemaCase(
        "float-bounds",
        "Report the temperature of the sun's surface in Celsius as JSON.",
        _obj(
            temperature={"type": "number", "minimum": -10.5, "maximum": 40.25},
            unit={"enum": ["C", "F"]},
        ),
    ),
    SchemaCase(
        "float-exclusive",
        "What is the probability that it rains tomorrow, and the humidity? As JSON.",
        _obj(
            probability={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            humidity={"type": "number", "minimum": 0, "exclusiveMaximum": 100},
        ),
    ),
    SchemaCase(
        "string-lengths",
        "Give an airport's full name and its code as JSON.",
        _obj(
            name={"type": "string", "minLength": 3, "maxLength": 10},
            code={"type": "string", "minLength": 3, "maxLength": 3},
        ),
    ),
    SchemaCase(
        "pattern",
        "Give a US zip code and a hex colour as JSON.",
        _obj(
            zip={"type": "string", "pattern": "^[0-9]{5}$"},
            color={"type": "string", "pattern": "^#[0-9a-f]{6}$"},
        ),
    ),
    SchemaCase(
        "pattern-and-length",
        "Write the longest English word you know and a social media handle as JSON.",
        _obj(
            word={"type": "string", "pattern": "^[a-z]+$", "maxLength": 6},
            handle={"type": "string", "pattern": "^@[a-z0-9_]+$", "minLength": 4, "maxLength": 9},
        ),
    ),
    SchemaCase(
        "enum-and-const",
        "Describe a traffic light's state as JSON.",
        _obj(
            kind={"const": "light"},
            version={"const": 2},
            color={"enum": ["red", "amber", "green"]},
            value={"enum": [1, "one", None, True]},
        ),
    ),
    SchemaCase(
        "nested-arrays",
        "Write a small grid of digits as JSON.",
        _obj(
            grid={
                "type": "array",
                "items": {"type": "array", "items": _DIGIT, "minItems": 2, "maxItems": 3},
                "minItems": 1,
                "maxItems": 2,
            }
        ),
    ),
    SchemaCase(
        "nested-objects",
        "Describe a famous novel and its author as JSON.",
        _obj(
            title={"type": "string", "maxLength": 24},
            author=_obj(
                name={"type": "string", "maxLength": 20},
                born={"type": "integer", "minimum": 1000, "maximum": 2024},
            ),
            tags={"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        ),
        max_tokens=64,
    ),
    SchemaCase(
        "optional-properties",
        "Describe a pet as JSON; add a nickname if it has one.",
        _obj(
            required=["name"],
            name={"type": "string", "maxLength": 10},
            nickname={"type": "string", "maxLength": 8},
            age={"type": "integer", "minimum": 0, "maximum": 30},
        ),
    ),
    SchemaCase(
        "array-counts",
        "List many fruits as JSON tags.",
        _obj(
            tags={
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            }
        ),
    ),
    SchemaCase(
        "nullable-bounds",
        "Rate the film Titanic from 1 to 5 as JSON.",
        _obj(rating={"type": ["integer", "null"], "minimum": 1, "maximum": 5}),
    ),
    SchemaCase(
        "multiple-of",
        "Give a discount percentage as JSON.",
        _obj(discount={"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}),
    ),
    SchemaCase(
        "format-date",
        "When did the Berlin wall fall? Answer as JSON.",
        _obj(event={"type": "string", "maxLength": 16}, when={"type": "string", "format": "date"}),
    ),
    SchemaCase(
        "one-of-tagged",
        "Describe a pet, a cat or a dog, as JSON.",
        {
            "oneOf": [
                _obj(kind={"const": "cat"}, lives={"type": "integer", "minimum": 1, "maximum": 9}),
                _obj(kind={"const": "dog"}, good={"type": "boolean"}),
            ]
        },
    ),
    SchemaCase(
        "all-of",
        "Give a point with x and y as JSON.",
        {
            "allOf": [
                _obj(x={"type": "integer"}, y={"type": "integer"}),
                {"properties": {"x": {"minimum": -5, "maximum": 5}, "y": {"maximum": 0}}},
            ]
        },
    ),
    SchemaCase(
        "ref-recursion",
        "Write the arithmetic expression 1 + 2 * 3 as a JSON tree.",
        {
            "$defs": {
                "expr": {
                    "anyOf": [
                        _DIGIT,
                        _obj(
                            op={"enum": ["+", "*"]},
                            args={
                                "type": "array",
                                "items": {"$ref": "#/$defs/expr"},
                                "minItems": 2,
                                "maxItems": 2,
                            },
                        ),
                    ]
                }
            },
            "$ref": "#/$defs/expr",
        },
        max_tokens=64,
    ),
    SchemaCase(
        "map-min-properties",
        "Give the scores of at least two players as a JSON object.",
        {
            "type": "object",
            "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 99},
            "minProperties": 2,
            "maxProperties": 3,
        },
    ),
    SchemaCase(
        "unique-items",
        "List three different lucky numbers as JSON.",
        _obj(numbers={"type": "array", "items": _DIGIT, "uniqueItems": True, "maxItems": 3}),
    ),
)
#: The schemas of the CI run (about a minute for both bundled backends, both modes).
CI_CASE_NAMES = (
    "plain-shapes",
    "int-bounds",
    "float-exclusive",
    "pattern-and-length",
    "enum-and-const",
    "nested-arrays",
    "optional-properties",
    "unique-items",
)
CI_CORPUS: tuple[SchemaCase, ...] = tuple(c for c in CORPUS if c.name in CI_CASE_NAMES)
CORPORA = {"ci": CI_CORPUS, "full": CORPUS}


# Results ---------------------------------------------------------------------------------


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


# Running --------------------------------------------------------------------------------


def _engine_kwargs(mode: Mode, llm_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "dtype": "float32",
        "block_size": 16,
        "num_kv_blocks": 256,
        "max_model_len": 1024,
    }
    settings.update(llm_kwargs or {})
    settings["async_scheduling"] = mode == "async"
    return settings


def _run_engine(
    model: str,
    backends: Sequence[str],
    mode: Mode,
    corpus: Sequence[SchemaCase],
    llm_kwargs: Mapping[str, Any] | None,
) -> list[CaseResult]:
    """One engine in `mode` running every case for each of `backends` (bundled backends
    share the engine through the request's `backend` field; a plugin name gets its own
    stack)."""
    from tandem import LLM, SamplingParams

    settings = _engine_kwargs(mode, llm_kwargs)
    plugin = None if all(b in BUNDLED_BACKENDS for b in backends) else backends[0]
    if plugin is not None:
        settings["plugins"] = ["reference-scheduler", "default-sampler", plugin]
    llm = LLM(model=model, **settings)
    try:
        prompts: list[str] = []
        params: list[Any] = []
        keys: list[tuple[str, SchemaCase]] = []
        for backend in backends:
            for case in corpus:
                spec: dict[str, Any] = {"json": case.schema}
                if plugin is None:
                    spec["backend"] = backend
                prompts.append(
                    llm.tokenizer.apply_chat_template(
                        [{"role": "user", "content": case.prompt}],
                        tokenize=False,
                        add_generation_prompt=True,
                    )
                )
                params.append(
                    SamplingParams(
                        temperature=0, max_tokens=case.max_tokens, structured_outputs=spec
                    )
                )
                keys.append((backend, case))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [
            classify(case, out, backend, mode)
            for (backend, case), out in zip(keys, outputs, strict=True)
        ]
    finally:
        llm.shutdown()


def _compare_modes(results: list[CaseResult]) -> None:
    """Mark async results whose tokens differ from sync's (greedy: they must not)."""
    sync = {(r.backend, r.case): r for r in results if r.mode == "sync"}
    for r in results:
        other = sync.get((r.backend, r.case))
        if r.mode != "async" or other is None or r.token_ids == other.token_ids:
            continue
        r.outcome = "error"
        r.detail = f"async output differs from sync: {r.text!r} vs {other.text!r}"


def run_grammar_conformance(
    backends: str | Sequence[str] = "auto",
    modes: Sequence[Mode] = MODES,
    corpus: Sequence[SchemaCase] | str = "ci",
    model: str = "default",
    llm_kwargs: Mapping[str, Any] | None = None,
) -> GrammarConformanceReport:
    """Run `corpus` (a `CORPORA` name or cases) for each backend in each mode; never
    raises for a failed case: see `GrammarConformanceReport.passed` /
    `raise_for_failures()`. Bundled backends (`xgrammar`, `outlines`, `auto`) share one
    engine per mode; a grammar plugin's entry-point name runs in its own stack."""
    names = [backends] if isinstance(backends, str) else list(backends)
    cases = CORPORA[corpus] if isinstance(corpus, str) else tuple(corpus)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    groups = [[n for n in names if n in BUNDLED_BACKENDS]] + [
        [n] for n in names if n not in BUNDLED_BACKENDS
    ]
    results: list[CaseResult] = []
    for group in groups:
        if not group:
            continue
        for mode in modes:
            results.extend(_run_engine(model, group, mode, cases, llm_kwargs))
    _compare_modes(results)
    order = {n: i for i, n in enumerate(names)}
    results.sort(key=lambda r: (order[r.backend], MODES.index(r.mode)))  # type: ignore[arg-type]
    return GrammarConformanceReport(names, results)


_REPORTS: dict[tuple[str, str], GrammarConformanceReport] = {}


def check_grammar_case(backend: str, case: str, mode: Mode, corpus: str = "ci") -> CaseResult:
    """The result of one case in one mode; raises `GrammarConformanceError` when it failed.
    The whole corpus runs (both modes) on the first call for a (backend, corpus) and is
    kept for the process (the pytest items call this once each)."""
    key = (backend, corpus)
    if key not in _REPORTS:
        _REPORTS[key] = run_grammar_conformance(backend, MODES, corpus)
    result = _REPORTS[key].result(backend, case, mode)
    if result.failed:
        raise GrammarConformanceError(f"{backend}: {result.line().strip()}")
    return result
