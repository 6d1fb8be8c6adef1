"""The n-gram (prompt-lookup) drafter: drafts are the tokens that followed an earlier
occurrence of the history's own suffix.

Semantics, per request with history h (prompt + outputs, length L) that sampled this step:
take the longest n in [prompt_lookup_min, prompt_lookup_max] such that the last n tokens
h[L-n:L] occur earlier, i.e. h[e-n:e] == h[L-n:L] for some end e <= L - 1 (so at least one
token follows the occurrence; occurrences may overlap the suffix). Among the ends of that
longest match, use the most recent one (the largest e): in rewriting and copying workloads
the latest occurrence is the one the model is currently reproducing. Propose
h[e : min(e + k, L)], at most k = num_speculative_tokens tokens. No match: no drafts. A
request that did not sample this step (a prefill chunk) gets no drafts.

Cost: each request's history lives in one row of a persistent int64 numpy buffer, grown by
doubling and appended to incrementally (only the tokens new since the last call are
copied). The search is batched over the requests: for every draft-match length t < max_n,
one shifted comparison of the whole `[batch, max_len]` window with each row's suffix token,
a running AND over t gives every end's match length, and one argmax picks (longest, most
recent). No Python work per history token.

Drafts are aligned (they continue the sampled tokens), so async scheduling may keep them in
the worker.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from tandem.core import hookimpl
from tandem.core.plugin_manager import NoOptions, TandemPlugin
from tandem.core.worker.draft_context import DraftContext
from tandem.schema.config import ConfigError, EngineConfig

#: Buffer filler left of position 0 and past a row's end; never equal to a token id.
_PAD = -2
#: A request's row is freed when the runner reports it finished or preempted
#: (`DraftContext.finished_req_ids`), or, as a backstop, after this many consecutive calls
#: without it; if it comes back its row is rebuilt from the context's history.
_EVICT_AFTER_CALLS = 64


class NgramDrafter(TandemPlugin):
    """Prompt-lookup drafting over prompt + output, vectorised across the batch."""

    role: ClassVar[str] = "drafter"
    speculative_methods: ClassVar[tuple[str, ...]] = ("ngram",)
    aligned_drafts: ClassVar[bool] = True
    Options = NoOptions

    def __init__(self, config: EngineConfig, options: NoOptions) -> None:
        super().__init__(config, options)
        spec = config.speculative
        if spec is None:
            raise ConfigError("ngram-drafter needs speculative: {method: ngram, ...}")
        if spec.prompt_lookup_min > spec.prompt_lookup_max:
            raise ConfigError(
                "speculative.prompt_lookup_min must be <= speculative.prompt_lookup_max"
            )
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max
        self.k = spec.num_speculative_tokens
        self._buf = np.full((16, 256), _PAD, dtype=np.int64)
        self._len = np.zeros(16, dtype=np.int64)
        self._last_seen = np.zeros(16, dtype=np.int64)
        self._slot: dict[str, int] = {}
        self._free: list[int] = list(range(15, -1, -1))
        self._calls = 0

    # History rows -----------------------------------------------------------------------
    def _grow(self, rows: int, cols: int) -> None:
        old_rows, old_cols = self._buf.shape
        new_rows, new_cols = old_rows, old_cols
        while new_rows < rows:
            new_rows *= 2
        while new_cols < cols:
            new_cols *= 2
        if (new_rows, new_cols) == (old_rows, old_cols):
            return
        buf = np.full((new_rows, new_cols), _PAD, dtype=np.int64)
        buf[:old_rows, :old_cols] = self._buf
        self._buf = buf
        if new_rows > old_rows:
            self._len = np.concatenate([self._len, np.zeros(new_rows - old_rows, np.int64)])
            self._last_seen = np.concatenate(
                [self._last_seen, np.zeros(new_rows - old_rows, np.int64)]
            )
            self._free.extend(range(new_rows - 1, old_rows - 1, -1))

    def _row(self, req_id: str, history: list[int]) -> int:
        """The request's buffer row, brought up to `history` (appending only what is new;
        rebuilt when the stored prefix no longer matches: shorter history, or a different
        first or last stored token). A stale row can only cost acceptance, never
        correctness: verification decides what is emitted."""
        slot = self._slot.get(req_id)
        if slot is None:
            if not self._free:
                self._grow(self._buf.shape[0] * 2, 0)
            slot = self._free.pop()
            self._slot[req_id] = slot
            self._len[slot] = 0
        stored = int(self._len[slot])
        n = len(history)
        if stored > n or (
            stored
            and (
                self._buf[slot, stored - 1] != history[stored - 1]
                or self._buf[slot, 0] != history[0]
            )
        ):
            self._buf[slot, :stored] = _PAD
            stored = 0
        if n > self._buf.shape[1]:
            self._grow(0, n)
        if n > stored:
            self._buf[slot, stored:n] = history[stored:]
        self._len[slot] = n
        self._last_seen[slot] = self._calls
        return slot

    def _evict_stale(self) -> None:
        stale = self._calls - self._last_seen > _EVICT_AFTER_CALLS
        if not stale.any():
            return
        for req_id, slot in list(self._slot.items()):
            if stale[slot]:
                self._release(req_id)

    # Drafting -----------------------------------------------------------------------------
    def propose(self, rows: np.ndarray, k: int) -> list[list[int]]:
        """At most `k` drafts for each of the buffer rows `rows` (the rule: module docstring)."""
        lengths = self._len[rows]
        width = int(lengths.max())
        max_n = self.max_n
        hist = self._buf[rows, :width]
        padded = np.concatenate([np.full((len(rows), max_n), _PAD, np.int64), hist], axis=1)
        ends = np.arange(1, width + 1)
        # match[i, e-1] stays True while h[e-1-t] == h[L-1-t] for every t so far.
        match = np.ones((len(rows), width), dtype=bool)
        match_len = np.zeros((len(rows), width), dtype=np.int64)
        for t in range(max_n):
            suffix_token = hist[np.arange(len(rows)), np.maximum(lengths - 1 - t, 0)]
            suffix_token = np.where(lengths - 1 - t >= 0, suffix_token, _PAD - 1)
            window = padded[:, max_n - t : max_n - t + width]  # h[e-1-t] for e = 1..width
            match &= window == suffix_token[:, None]
            match_len += match
        # An occurrence must end before the history does (a token must follow it).
        valid = ends[None, :] <= (lengths - 1)[:, None]
        score = np.where(valid & (match_len >= self.min_n), match_len * (width + 1) + ends, -1)
        best = score.argmax(axis=1)
        found = score[np.arange(len(rows)), best] >= 0
        drafts: list[list[int]] = []
        for i in range(len(rows)):
            if not found[i]:
                drafts.append([])
                continue
            end = int(best[i]) + 1
            stop = min(end + k, int(lengths[i]))
            proposal = hist[i, end:stop].tolist()
            if proposal and min(proposal) < 0:  # never propose an unresolved placeholder
                proposal = proposal[: next(j for j, t in enumerate(proposal) if t < 0)]
            drafts.append(proposal)
        return drafts

    def _release(self, req_id: str) -> None:
        slot = self._slot.pop(req_id, None)
        if slot is not None:
            self._buf[slot, : self._len[slot]] = _PAD
            self._len[slot] = 0
            self._free.append(slot)

    @hookimpl
    def propose_drafts(self, context: DraftContext) -> list[list[int]]:
        self._calls += 1
        for req_id in context.finished_req_ids:  # finished or preempted since the last call
            self._release(req_id)
        out: list[list[int]] = [[] for _ in context.req_ids]
        drafting: list[int] = []
        rows: list[int] = []
        for i, (req_id, history, sampled) in enumerate(
            zip(context.req_ids, context.token_ids, context.sampled_token_ids, strict=True)
        ):
            if sampled and len(history) > self.min_n:
                drafting.append(i)
                rows.append(self._row(req_id, history))
        if rows:
            k = min(self.k, context.num_spec_tokens)
            for i, drafts in zip(drafting, self.propose(np.asarray(rows), k), strict=True):
                out[i] = drafts
        if self._calls % _EVICT_AFTER_CALLS == 0:
            self._evict_stale()
        return out
