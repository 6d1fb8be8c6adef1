"""tandem's `SampleLogprobs` in the OpenAI API's two shapes.

Completions: `{tokens, token_logprobs, top_logprobs, text_offset}` (one entry per output
token; `top_logprobs[i]` maps the top-N tokens' text, and the sampled token's, to their
logprob). Chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}]}` with the N most likely tokens, most likely first. A token without text (no
tokenizer, or `detokenize` off) is written `token_id:<id>`, as vLLM's
`return_tokens_as_token_ids` does; `-inf` becomes -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tandem.outputs import Logprob, PromptLogprobs, SampleLogprobs
from tandem.server.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobsJSON,
)

_FLOOR = -9999.0


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


def _chat_entry(token_id: int, logprob: Logprob | None) -> ChatCompletionLogProb:
    text = token_text(token_id, logprob)
    value = _value(logprob.logprob) if logprob is not None else _FLOOR
    return ChatCompletionLogProb(token=text, logprob=value, bytes=list(text.encode("utf-8")))


def chat_logprobs(
    token_ids: list[int], logprobs: SampleLogprobs, num_top: int
) -> ChatCompletionLogProbs:
    """The chat API's logprobs of `token_ids` with `num_top` alternatives each."""
    content = []
    for token_id, step in zip(token_ids, logprobs, strict=False):
        entry = _chat_entry(token_id, step.get(token_id))
        top = [_chat_entry(t, lp) for t, lp in _top(step, num_top)]
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
