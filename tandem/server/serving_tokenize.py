"""POST /tokenize and POST /detokenize (vLLM's shapes).

`/tokenize` takes `{"prompt": text}` (special tokens added unless `add_special_tokens` is
false) or `{"messages": [...]}` (through the chat template, as chat completions renders
it) and answers `{"count", "max_model_len", "tokens", "token_strs"}`; `/detokenize` takes
`{"tokens": [...]}` and answers `{"prompt": text}`. Both need the model's tokenizer (a 400
naming the field on a model without one).
"""

from __future__ import annotations

from typing import Any

from tandem.server.errors import bad_request
from tandem.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from tandem.server.serving_chat import render_chat
from tandem.server.serving_common import tokenize


def tokenize_response(engine: Any, req: TokenizeRequest) -> dict[str, Any]:
    """The body of POST /tokenize."""
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt: give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        ids = render_chat(engine, req.messages, req).token_ids
    else:
        assert req.prompt is not None
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenize(engine.tokenizer, req.prompt, add_special, "prompt").token_ids
    strs = None
    if req.return_token_strs:
        strs = engine.tokenizer.convert_ids_to_tokens(ids)
    return TokenizeResponse(
        count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs
    ).model_dump()


def detokenize_response(engine: Any, req: DetokenizeRequest) -> dict[str, Any]:
    """The body of POST /detokenize."""
    if engine.tokenizer is None:
        raise bad_request(
            "tokens: detokenizing needs a tokenizer; this model has none", param="tokens"
        )
    vocab = getattr(engine.config.model, "vocab_size", None) if hasattr(engine, "config") else None
    bad = [t for t in req.tokens if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise bad_request(f"tokens: token id {bad[0]} is outside the vocabulary", param="tokens")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens)).model_dump()
