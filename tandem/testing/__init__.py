"""Test kit for tandem and its plugin authors: the scripted model, engine builders, the
reference output of the scripted model, and the invariant checker.

Also a pytest plugin (registered under `pytest11`) providing fixtures; see
`tandem.testing.pytest_plugin`.
"""

from tandem.core.invariants import InvariantViolation, check_invariants
from tandem.core.worker.scripted_model import ScriptedModel, scripted_next_token
from tandem.testing.engine import (
    collect_outputs,
    expected_scripted_output,
    make_request,
    make_scripted_engine,
    scripted_config,
)

__all__ = [
    "InvariantViolation",
    "ScriptedModel",
    "check_invariants",
    "collect_outputs",
    "expected_scripted_output",
    "make_request",
    "make_scripted_engine",
    "scripted_config",
    "scripted_next_token",
]
