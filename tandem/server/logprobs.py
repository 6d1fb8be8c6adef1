"""tandem's `SampleLogprobs` in the OpenAI API's two shapes.

Completions: `{tokens, token_logprobs, top_logprobs, text_offset}` (one entry per output
token; `top_logprobs[i]` maps the top-N tokens' text, and the sampled token's, to their
logprob). Chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}]}` with the N most likely tokens, most likely first. A token without text (no
tokenizer, or `detokenize` off) is written `token_id:<id>`, as vLLM's
`return_tokens_as_token_ids` does; `-inf` becomes -9999.0 (JSON has no infinity).

A chat entry's `bytes` are the token's own raw bytes (`TokenBytes`, from the tokenizer's
vocabulary), so the `bytes` of the generated tokens, joined, are the UTF-8 of the text
even where a character (an emoji) is split across tokens; `token` stays the token's text as
vLLM writes it (U+FFFD for a partial character). Without a vocabulary to read (no
tokenizer, a tokenizer without a byte-level or byte-fallback vocabulary) `bytes` are the
UTF-8 of `token`, as in vLLM.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from tandem.schema.outputs import Logprob, PromptLogprobs, SampleLogprobs
from tandem.server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobsJSON,
)

_FLOOR = -9999.0
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: each printable character of a byte-level
    token stands for one byte (printable Latin-1 bytes for themselves, the other bytes
    for the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(0x100 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenBytes:
    """Token id -> the token's raw bytes, read from the tokenizer's vocabulary (byte-level
    BPE, or SentencePiece with `<0xNN>` byte fallback); cached per id."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, bytes | None] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = repr(getattr(backend, "decoder", None))
        self._byte_level = "ByteLevel" in decoder
        self._sentencepiece = not self._byte_level and (
            "Metaspace" in decoder or "ByteFallback" in decoder
        )
        self._decoder = _byte_decoder() if self._byte_level else {}
        added = getattr(tokenizer, "get_added_vocab", None)
        self._added = {i: t for t, i in added().items()} if callable(added) else {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        """The raw bytes of `token_id` (whose text as shown is `text`)."""
        raw = self._cache[token_id] if token_id in self._cache else self._read(token_id)
        return list(raw if raw is not None else text.encode("utf-8", errors="replace"))

    def _read(self, token_id: int) -> bytes | None:
        raw: bytes | None = None
        if self.tokenizer is not None and hasattr(self.tokenizer, "convert_ids_to_tokens"):
            try:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
            except (IndexError, KeyError, OverflowError, TypeError, ValueError):
                piece = None
            if isinstance(piece, str):
                raw = self._piece_bytes(token_id, piece)
        if len(self._cache) < 1 << 20:
            self._cache[token_id] = raw
        return raw

    def _piece_bytes(self, token_id: int, piece: str) -> bytes | None:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if self._byte_level:
            if all(c in self._decoder for c in piece):
                return bytes(self._decoder[c] for c in piece)
            return None
        if not self._sentencepiece:
            return None
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # U+2581: a word boundary


def token_text(token_id: int, logprob: Logprob | None) -> str:
    """The token's text as the API shows it (`token_id:<id>` when there is none)."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return f"token_id:{token_id}"


def _value(logprob: float) -> float:
    return _FLOOR if math.isnan(logprob) or logprob < _FLOOR else logprob


def _top(step: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The `num` most likely entries of one step, most likely first."""
    ranked = sorted(
        step.items(),
        key=lambda item: (item[1].rank if item[1].rank is not None else 1 << 30, -item[1].logprob),
    )
    return ranked[:num]


def completion_logprobs(
    token_ids: list[int],
    logprobs: SampleLogprobs | PromptLogprobs,
    num_top: int,
    text_offset: int,
    decode: Callable[[int], str] | None = None,
) -> CompletionLogProbs:
    """The completions API's logprobs of `token_ids`; offsets start at `text_offset`. A
    step that is None (an echoed prompt's first token) has a null logprob and null top
    logprobs, and its text from `decode` (`token_id:<id>` without one), as in vLLM."""
    out = CompletionLogProbs()
    offset = text_offset
    for token_id, step in zip(token_ids, logprobs, strict=False):
        if step is None:
            text = decode(token_id) if decode is not None else token_text(token_id, None)
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(text)
            continue
        sampled = step.get(token_id)
        text = token_text(token_id, sampled)
        out.tokens.append(text)
        out.token_logprobs.append(_value(sampled.logprob) if sampled is not None else None)
        top = {token_text(t, lp): _value(lp.logprob) for t, lp in _top(step, num_top)}
        if sampled is not None:
            top.setdefault(text, _value(sampled.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(sampled.decoded_token or "") if sampled is not None else 0
    return out


#: The served model's `TokenBytes` (`use_vocabulary`, called by `build_app`): one server
#: process serves one model, and the chat logprobs read its vocabulary.
_served: TokenBytes | None = None


def use_vocabulary(tokenizer: Any | None) -> None:
    """Take `tokenizer`'s vocabulary for the raw `bytes` of chat logprobs from now on."""
    global _served
    _served = TokenBytes(tokenizer) if tokenizer is not None else None


def _chat_entry(
    token_id: int, logprob: Logprob | None, token_bytes: TokenBytes | None
) -> ChatCompletionLogProb:
    text = token_text(token_id, logprob)
    value = _value(logprob.logprob) if logprob is not None else _FLOOR
    raw = (
        token_bytes(token_id, text)
        if token_bytes is not None and logprob is not None and logprob.decoded_token is not None
        else list(text.encode("utf-8", errors="replace"))
    )
    return ChatCompletionLogProb(token=text, logprob=value, bytes=raw)


def chat_logprobs(
    token_ids: list[int],
    logprobs: SampleLogprobs,
    num_top: int,
    token_bytes: TokenBytes | None = None,
) -> ChatCompletionLogProbs:
    """The chat API's logprobs of `token_ids` with `num_top` alternatives each; `bytes`
    are the raw bytes of each token from `token_bytes` (default: the served model's)."""
    token_bytes = token_bytes if token_bytes is not None else _served
    content = []
    for token_id, step in zip(token_ids, logprobs, strict=False):
        entry = _chat_entry(token_id, step.get(token_id), token_bytes)
        top = [_chat_entry(t, lp, token_bytes) for t, lp in _top(step, num_top)]
        content.append(ChatCompletionLogProbsContent(**entry.model_dump(), top_logprobs=top))
    return ChatCompletionLogProbs(content=content)


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsJSON | None:
    """vLLM's `prompt_logprobs` body: per prompt token {token id: {logprob, rank,
    decoded_token}} (the prompt token and the top-N), None for the first token; -inf
    becomes -9999.0."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if step is None
        else {
            str(token_id): PromptLogprob(
                logprob=_value(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in step.items()
        }
        for step in prompt_logprobs
    ]
