"""Grammar-valid tokens for the token oracle: the simulated device obeys the step's bitmask.

`TokenOracle` decides which requests sample and how many drafts each accepts, and fills
every sampled position with one fixed id. For a constrained request that id would break
its grammar, so `GrammarTokens.apply` rewrites the oracle's answer for the rows of the
step's `grammar_bitmask` (the layout of the hook: `1 + drafts` rows per request of
`structured_output_request_ids`, in that order):

- a draft counts as accepted only while its row allows it (a rejection sampler never keeps
  a token the mask forbids), so the oracle's accepted prefix is cut at the first draft the
  grammar rejects; the oracle's own ledger (`computed`, `known`) and the output's
  `num_rejected_drafts` follow the cut;
- the token after the accepted drafts is a seeded random choice among the ids its row
  allows, never EOS unless EOS is the only one (so a grammar ends only when it must: the
  request then stops, or runs to its length while the grammar still allows more).

The choice is one tensor operation over the step's constrained rows. Unconstrained rows
keep the oracle's fixed id. Invariant: every token this returns for a constrained request
is accepted by that request's matcher, in order.
"""

from __future__ import annotations

import torch

from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.scheduler_output import SchedulerOutput
from tandem.core.worker.token_oracle import TokenOracle

_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool `[len(rows), vocab_size]`: token t of row i is allowed (bit t % 32 of word
    t // 32 of `bitmask[rows[i]]`)."""
    words = bitmask.index_select(0, rows)
    return ((words.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)[:, :vocab_size]


class GrammarTokens:
    """Seeded token choice for constrained rows (one seed gives one run)."""

    def __init__(self, vocab_size: int, eos_token_id: int | None, seed: int = 0) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size: expected >= 1, got {vocab_size}")
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        self.generator = torch.Generator().manual_seed(seed)
        #: Constrained tokens chosen, and drafts cut because the grammar rejected them.
        self.num_tokens, self.num_drafts_cut = 0, 0

    def choose(self, bitmask: torch.Tensor, rows: list[int]) -> list[int]:
        """One allowed id per row of `rows`, uniformly at random, EOS only when it is the
        row's sole allowed id (a row that allows nothing gives EOS: the grammar is done)."""
        allowed = allowed_tokens(bitmask, torch.tensor(rows, dtype=torch.long), self.vocab_size)
        eos = self.eos_token_id
        if eos is not None and eos < self.vocab_size:
            others = allowed.sum(1) - allowed[:, eos].long()
            allowed[:, eos] = others == 0  # EOS only where nothing else is allowed
        scores = torch.rand(allowed.shape, generator=self.generator)
        scores.masked_fill_(~allowed, -1.0)
        self.num_tokens += len(rows)
        return scores.argmax(1).tolist()

    def apply(
        self,
        output: ModelRunnerOutput,
        step: SchedulerOutput,
        bitmask: torch.Tensor,
        oracle: TokenOracle,
    ) -> None:
        """Rewrite the oracle's `output` of `step` in place for its constrained requests
        (module docstring); the oracle's drafts are its fixed id."""
        spec, index = step.scheduled_spec_decode_tokens, output.req_id_to_index
        token = oracle.token_id
        draft_ok = ((bitmask[:, token // 32] >> (token % 32)) & 1).bool().tolist()
        picks: list[tuple[int, int]] = []  # (output index, bitmask row of the bonus token)
        row = 0
        for rid in step.structured_output_request_ids:
            num_drafts = len(spec.get(rid, ()))
            i = index.get(rid)
            if i is not None:  # it sampled this step (a prefill chunk short of its end did not)
                accepted = len(output.sampled_token_ids[i]) - 1
                kept = 0
                while kept < accepted and draft_ok[row + kept]:
                    kept += 1
                if kept < accepted:  # the grammar rejects a draft the oracle accepted
                    oracle.computed[rid] -= accepted - kept
                    oracle.known[rid] = oracle.computed[rid] + 1
                    output.num_rejected_drafts[rid] = num_drafts - kept
                    output.sampled_token_ids[i] = [token] * (kept + 1)
                    self.num_drafts_cut += accepted - kept
                picks.append((i, row + kept))
            row += 1 + num_drafts
        if row != bitmask.shape[0]:
            raise ValueError(
                f"grammar_bitmask: {bitmask.shape[0]} rows for a step whose constrained "
                f"requests need {row}"
            )
        if picks:
            chosen = self.choose(bitmask, [r for _, r in picks])
            for (i, _), choice in zip(picks, chosen, strict=True):
                output.sampled_token_ids[i][-1] = choice
