"""pytest plugin `tandem`: fixtures for testing tandem plugins against the reference engine.

Fixtures:
- `scripted_engine_factory`: build an `EngineCore` on the scripted model with invariant
  checks after every step (keywords override config fields).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture
def scripted_engine_factory() -> Iterator[Callable[..., Any]]:
    from tandem.testing.engine import make_scripted_engine

    engines = []

    def factory(**overrides: Any) -> Any:
        engine = make_scripted_engine(**overrides)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.shutdown()
