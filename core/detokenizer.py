"""Incremental detokenisation and stop strings.

Text grows by decoding a short window of recent tokens and taking the new suffix, so each
token costs O(window), and a token that ends inside a multi-byte character (decoded as
U+FFFD) waits for the next one. Stop strings are searched only in the region the new text
could have completed, so a stop string spanning two tokens is caught.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Text of one request's output tokens; `append` reports a matched stop string.

    Invariant: `text` is the decoded output (without the stop string unless
    `include_stop_str_in_output`), never loses text before a stop string.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str],
        include_stop_str_in_output: bool,
        min_tokens: int,
        skip_special_tokens: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._max_stop_len = max((len(s) for s in stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def append(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string that ended the output, if one did."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            full = self._decode(self.token_ids[self._prefix_offset :])
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                continue
            before = len(self.text)
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            if self.stop and len(self.token_ids) > self.min_tokens:
                matched = self._find_stop(before)
                if matched is not None:
                    return matched
        return None

    def _find_stop(self, new_text_start: int) -> str | None:
        window_start = max(0, new_text_start - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, window_start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
        return stop
