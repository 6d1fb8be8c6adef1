"""The test kit's plugin doubles, registered by class when `tandem.testing` is imported
(the `tandem` pytest plugin imports it in every pytest session), never shipped as entry
points. Stacks keep naming them; a worker in another process imports them by path.

- `scripted-drafter`: drafts for the scripted model with a chosen number of correct tokens
  (`speculative: {method: scripted, ...}` picks it in a default stack).
- `fake-grammar`: a mask that depends on the previous token (backend name `fake`), to test
  deferred sampling under async scheduling on the scripted model.
- `fault-sampler`: raises inside `sample` for chosen requests (failure isolation).
"""

from __future__ import annotations

from tandem.plugin_discovery import register_plugin
from tandem.testing.fake_grammar import FakeGrammar
from tandem.testing.fault_sampler import FaultSampler
from tandem.testing.scripted_drafter import ScriptedDrafter

#: Name -> class of every double.
TEST_PLUGINS: dict[str, type] = {
    "scripted-drafter": ScriptedDrafter,
    "fake-grammar": FakeGrammar,
    "fault-sampler": FaultSampler,
}


def register_test_plugins() -> None:
    """Make the doubles resolvable by name in this process (idempotent)."""
    for name, cls in TEST_PLUGINS.items():
        register_plugin(name, cls)
