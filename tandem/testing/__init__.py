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

from tandem.plugins.invariant_checker import InvariantViolation, check_invariants
from tandem.testing.conformance import (
    CHECKS,
    ConformanceError,
    ConformanceReport,
    check_conformance,
    ledger_trace,
    reference_outputs,
    run_conformance,
)
from tandem.testing.doubles import TEST_PLUGINS, register_test_plugins
from tandem.testing.engine import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    make_scripted_engine,
    make_scripted_llm,
    scripted_config,
)
from tandem.testing.grammar_conformance import (
    GrammarConformanceError,
    GrammarConformanceReport,
    run_grammar_conformance,
)
from tandem.testing.scripted_model import ScriptedModel, scripted_next_token

register_test_plugins()

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
