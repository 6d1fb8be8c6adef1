"""`most-kv-victim`: preempt the RUNNING request that holds the most KV, with a starvation
bound. The tutorial's plugin (docs/policy-plugin-tutorial.md).

Freeing the largest holder returns the most blocks with one preemption, so fewer requests
lose their progress in a step. Alone, that rule starves a long request: it always holds
the most KV, so it is chosen again and again while short requests stream past. The bound:
a request preempted `max_preemptions` times is not chosen while a candidate preempted
fewer times runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin
from tandem.core.request import Request


class MostKVOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_preemptions: int = Field(2, ge=1, description="preemptions before a request is spared")


class MostKVVictim(TandemPlugin):
    """Chooses the victim holding the most KV; spares requests preempted too often."""

    Options = MostKVOptions

    @hookimpl
    def select_preemption_victim(self, running: Sequence[Request], needed_by: Request) -> Request:
        bound = self.options.max_preemptions
        fresh = [r for r in running if r.num_preemptions < bound]
        candidates = fresh or list(running)
        # Most computed tokens first; ties go to the most recently admitted.
        return max(reversed(candidates), key=lambda r: r.num_computed_tokens)
