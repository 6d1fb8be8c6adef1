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

The corpus is in `grammar_corpus.py`, the classification and report in
`grammar_outcomes.py`; this module runs the corpus through engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from tandem.testing.grammar_corpus import (
    CI_CASE_NAMES,
    CI_CORPUS,
    CORPORA,
    CORPUS,
    DEFAULT_MAX_TOKENS,
    SchemaCase,
)
from tandem.testing.grammar_outcomes import (
    FAILING,
    CaseResult,
    GrammarConformanceError,
    GrammarConformanceReport,
    Outcome,
    classify,
    refused_keyword,
    schema_errors,
)

__all__ = [
    "BUNDLED_BACKENDS",
    "CI_CASE_NAMES",
    "CI_CORPUS",
    "CORPORA",
    "CORPUS",
    "DEFAULT_MAX_TOKENS",
    "FAILING",
    "MODES",
    "CaseResult",
    "GrammarConformanceError",
    "GrammarConformanceReport",
    "Mode",
    "Outcome",
    "SchemaCase",
    "check_grammar_case",
    "classify",
    "refused_keyword",
    "run_grammar_conformance",
    "schema_errors",
]

Mode = Literal["sync", "async"]
MODES: tuple[Mode, ...] = ("sync", "async")
#: Backends of the bundled `structured-output` plugin.
BUNDLED_BACKENDS = ("xgrammar", "outlines", "auto")


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
