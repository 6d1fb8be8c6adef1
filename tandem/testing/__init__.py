"""Test kit for tandem and its plugin authors: the scripted model (and its loader), engine
builders, the reference output of the scripted model, the invariant checker, the plugin
doubles (`scripted-drafter`, `fake-grammar`, `fault-sampler`: registered by class when this
package is imported, see `tandem.testing.doubles`), the scheduler plugin conformance suite
(`tandem.testing.conformance`: `run_conformance(NAME or class)`, or
`pytest -p tandem --tandem-conformance NAME`), and the grammar-backend conformance check
(`run_grammar_conformance(BACKEND)`, or `pytest -p tandem --tandem-grammar-conformance
BACKEND`).

Also a pytest plugin (registered under `pytest11`) providing fixtures; see
`tandem.testing.pytest_plugin`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tandem.plugins.invariant_checker import InvariantViolation, check_invariants
from tandem.testing.doubles import TEST_PLUGINS, register_test_plugins
from tandem.testing.engine import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    make_scripted_engine,
    make_scripted_llm,
    scripted_config,
)
from tandem.testing.scripted_model import ScriptedModel, scripted_next_token

if TYPE_CHECKING:
    from tandem.testing.conformance import (
        CHECKS,
        ConformanceError,
        ConformanceReport,
        check_conformance,
        ledger_trace,
        reference_outputs,
        run_conformance,
    )
    from tandem.testing.grammar_conformance import (
        GrammarConformanceError,
        GrammarConformanceReport,
        run_grammar_conformance,
    )

register_test_plugins()

#: Names imported on first use (PEP 562): the conformance kits are not imported with the
#: package, so an engine that only looks at the scripted model's loader (every engine does,
#: when it lists the installed loaders) does not hold them (about 1 MB of resident memory).
_LAZY = {
    "tandem.testing.conformance": (
        "CHECKS",
        "ConformanceError",
        "ConformanceReport",
        "check_conformance",
        "ledger_trace",
        "reference_outputs",
        "run_conformance",
    ),
    "tandem.testing.grammar_conformance": (
        "GrammarConformanceError",
        "GrammarConformanceReport",
        "run_grammar_conformance",
    ),
}
_LAZY_MODULE = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY_MODULE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CHECKS",
    "ConformanceError",
    "ConformanceReport",
    "GrammarConformanceError",
    "GrammarConformanceReport",
    "InvariantViolation",
    "ScriptedModel",
    "TEST_PLUGINS",
    "check_conformance",
    "check_invariants",
    "collect_outputs",
    "expected_scripted_output",
    "ledger_trace",
    "make_request",
    "make_scripted_engine",
    "make_scripted_llm",
    "reference_outputs",
    "register_test_plugins",
    "run_conformance",
    "run_grammar_conformance",
    "scripted_config",
    "scripted_next_token",
]


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_MODULE})
