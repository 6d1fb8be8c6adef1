"""Incremental detokenisation and stop strings.

Text grows by decoding a short window of recent tokens and taking the new suffix, so each
token costs O(window), and a token that ends inside a multi-byte character (decoded as
U+FFFD) waits for the next one. Stop strings are searched only in the region the new text
could have completed, so a stop string spanning two tokens is caught.

As in vLLM, a request the engine ended with a stop (EOS or one of `stop_token_ids`) keeps
that token in its token ids but not its text, unless `include_stop_str_in_output`. While
a request runs, `visible_text` holds back the last `max(len(stop)) - 1` characters
(stop strings excluded from the output), so streamed text is never retracted.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Text of one request's output tokens; `append` reports a matched stop string.

    Invariant: `text` is the decoded output (without the stop string, or the text of a
    stop token that ended the request, unless `include_stop_str_in_output`), never loses
    text before a stop string; `token_ids` holds every token appended, the stop token too.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str],
        include_stop_str_in_output: bool,
        min_tokens: int,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.skip_special = skip_special_tokens
        self.spaces_between_special = spaces_between_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._max_stop_len = max((len(s) for s in stop), default=0)
        #: Characters `visible_text` holds back while the request runs.
        self.stop_buffer_length = (
            self._max_stop_len - 1 if stop and not include_stop_str_in_output else 0
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special,
            spaces_between_special_tokens=self.spaces_between_special,
        )

    def visible_text(self, finished: bool) -> str:
        """The text a client may see now: all of it once finished, else all but the last
        `stop_buffer_length` characters (a stop string may still cut them)."""
        if finished or not self.stop_buffer_length:
            return self.text
        return self.text[: max(len(self.text) - self.stop_buffer_length, 0)]

    def append(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Add tokens; return the stop string that ended the output, if one did.

        `stop_terminated`: the engine ended the request at the last of these tokens (EOS
        or a stop token id); its text is left out unless `include_stop_str_in_output`."""
        skipped: int | None = None
        if stop_terminated and new_token_ids and not self.include_stop:
            *new_token_ids, skipped = new_token_ids
        stop = self._append(new_token_ids)
        if skipped is not None and stop is None:
            self.token_ids.append(skipped)
        return stop

    def _append(self, new_token_ids: list[int]) -> str | None:
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
