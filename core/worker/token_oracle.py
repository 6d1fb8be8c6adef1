"""Tokens without a model: the worker's bookkeeping of a step, reduced to counting.

A simulated device needs to know only *which* requests sample a token in a step and how
many drafts each accepts, not the token values. `TokenOracle` follows the worker's own
rules (a request samples when the step computes its last known token; a request verifying
k drafts accepts a prefix of them) and answers with a `ModelRunnerOutput` whose token ids
are a fixed non-EOS id. Speculative decoding uses an acceptance model: each draft is
accepted with probability `acceptance_rate`, independently, until the first rejection
(seeded, so one seed gives one run); the oracle proposes `num_spec_tokens` drafts for every
request that sampled. Invariant: for every live request, `computed <= known`, both counted
as the worker would count them (prompt and accepted outputs).
"""

from __future__ import annotations

import random

from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.scheduler_output import SchedulerOutput


class TokenOracle:
    """Per-request (computed, known) token counts; `step` turns a scheduler output into the
    worker's answer. `token_id` is what every sampled position holds (pick one that is
    neither EOS nor a stop token; simulated requests ignore EOS anyway)."""

    def __init__(
        self,
        token_id: int = 2,
        num_spec_tokens: int = 0,
        acceptance_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(
                f"acceptance_rate: expected a probability in [0, 1], got {acceptance_rate}"
            )
        self.token_id, self.num_spec_tokens = token_id, num_spec_tokens
        self.acceptance_rate = acceptance_rate
        self.rng = random.Random(seed)
        self.computed: dict[str, int] = {}
        self.known: dict[str, int] = {}

    def _accepted(self, num_drafts: int) -> int:
        accepted = 0
        while accepted < num_drafts and self.rng.random() < self.acceptance_rate:
            accepted += 1
        return accepted

    def step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply one step in step order (as the worker executes them)."""
        computed, known = self.computed, self.known
        for rid in scheduler_output.finished_req_ids:
            computed.pop(rid, None)
            known.pop(rid, None)
        for rid in scheduler_output.preempted_req_ids:
            computed.pop(rid, None)
            known.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
            known[new.req_id] = len(new.token_ids)
        spec = scheduler_output.scheduled_spec_decode_tokens
        out = ModelRunnerOutput()
        token, propose = self.token_id, self.num_spec_tokens
        drafts: dict[str, list[int]] | None = {} if propose else None
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            k = len(spec.get(rid, ()))
            done = computed[rid] + n
            if done - k < known[rid]:  # a prefill chunk short of the last known token
                computed[rid] = done
                continue
            accepted = self._accepted(k) if k else 0
            if k:
                out.num_rejected_drafts[rid] = k - accepted
            computed[rid] = done - (k - accepted)
            known[rid] = computed[rid] + 1
            out.req_id_to_index[rid] = len(out.req_ids)
            out.req_ids.append(rid)
            out.sampled_token_ids.append([token] * (accepted + 1))
            if drafts is not None:
                drafts[rid] = [token] * propose
        out.draft_token_ids = drafts
        return out
