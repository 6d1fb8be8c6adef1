"""Acceptance accounting for speculative decoding."""

from __future__ import annotations


class SpecDecodeMetrics:
    """Counts drafts and accepted drafts, overall and per draft position.

    Mean acceptance length is the mean number of tokens a verifying step yields
    (accepted drafts plus the one sampled token).
    """

    def __init__(self, num_spec_tokens: int) -> None:
        self.num_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * max(num_spec_tokens, 0)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0

    def as_dict(self) -> dict[str, object]:
        steps = max(self.num_steps, 1)
        return {
            "num_verify_steps": self.num_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_position": [a / steps for a in self.accepted_per_position],
        }
