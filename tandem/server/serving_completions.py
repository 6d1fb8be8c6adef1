"""POST /v1/completions (vLLM's `OpenAIServingCompletion`).

A request holds one prompt or a batch (strings or token-id lists); each prompt runs as one
engine request with `n` sequences, and choice `i * n + j` is prompt i's sequence j, as in
vLLM. Not streaming, the response comes when every prompt finished (`FINAL_ONLY`);
streaming, each new piece of a sequence is one chunk (`DELTA`), the chunk that finishes it
carries `finish_reason`, and `stream_options.include_usage` adds a last chunk with
`choices: []` and `usage`. On a model without a tokenizer the text is "": choices then
carry `token_ids` (vLLM's `return_token_ids`) and the usage counts are exact.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from tandem.schema.outputs import CompletionOutput, RequestOutput
from tandem.schema.sampling_params import SamplingParams
from tandem.server.errors import APIError
from tandem.server.logprobs import completion_logprobs, prompt_logprobs_json
from tandem.server.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    usage,
)
from tandem.server.serving_common import (
    OutputMerger,
    Prompt,
    prompt_len,
    random_id,
    run_blocking,
    tokenize,
    with_bad_words_each,
)
from tandem.server.to_sampling_params import (
    completion_max_tokens,
    completion_sampling_params,
    max_tokens_for,
)


class OpenAIServingCompletion:
    """Answers completions requests on one `AsyncLLM`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        raw = req.prompt
        if isinstance(raw, str):
            return [tokenize(self.engine.tokenizer, raw, req.add_special_tokens, "prompt")]
        if not raw:
            raise APIError(400, "prompt: expected at least one prompt", param="prompt")
        if isinstance(raw[0], int):
            return [Prompt(None, list(raw))]  # type: ignore[arg-type]
        prompts = []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                prompts.append(
                    tokenize(self.engine.tokenizer, item, req.add_special_tokens, f"prompt.{i}")
                )
            elif not item:
                raise APIError(400, f"prompt.{i}: the prompt is empty", param=f"prompt.{i}")
            else:
                prompts.append(Prompt(None, list(item)))
        return prompts

    def _params(self, req: CompletionRequest, prompts: list[Prompt]) -> list[SamplingParams]:
        defaults = self.engine.get_default_sampling_params()
        max_len = self.engine.max_model_len
        params = []
        asked, cap = completion_max_tokens(req)
        for prompt in prompts:
            length = prompt_len(prompt, req.truncate_prompt_tokens, max_len)
            budget = max_tokens_for(asked, length, max_len, defaults, "max_tokens", cap)
            params.append(completion_sampling_params(req, budget, defaults))
        return params

    async def create(self, req: CompletionRequest, model_name: str) -> dict[str, Any] | Any:
        """The response body (a dict), or an async iterator of JSON chunks when streaming.
        Raises `APIError` (or an engine error) before any output when refused."""
        prompts = await run_blocking(self._prompts, req)  # tokenising: off the event loop
        params = await with_bad_words_each(self.engine, self._params(req, prompts))
        request_id = req.request_id or random_id("cmpl")
        gens = [
            self.engine.generate(
                p.as_engine_prompt(), sp, f"{request_id}-{i}", priority=req.priority
            )
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        merger = OutputMerger(gens)
        await merger.start()
        want_ids = bool(req.return_token_ids) or self.engine.tokenizer is None
        tokenizer = self.engine.tokenizer
        if req.stream:
            return _Stream(
                req, model_name, request_id, prompts, merger, want_ids, tokenizer
            ).chunks()
        try:
            finals: dict[int, RequestOutput] = {}
            async for i, out in merger:
                finals[i] = out
        finally:
            merger.close()
        response = _response(req, model_name, request_id, prompts, finals, want_ids, tokenizer)
        return response.model_dump()


def _echo(req: CompletionRequest, prompt: Prompt, out: RequestOutput, tokenizer: Any) -> str:
    """The prompt text `echo` puts before the output: the prompt as given, or a token-id
    prompt detokenised ("" without a tokenizer)."""
    if not req.echo:
        return ""
    if prompt.text is not None:
        return prompt.text
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def _decoder(tokenizer: Any) -> Any:
    return (lambda token_id: tokenizer.decode([token_id])) if tokenizer is not None else None


def _logprobs(
    req: CompletionRequest,
    out: RequestOutput,
    c: CompletionOutput,
    offset: int,
    echoed: bool,
    tokenizer: Any,
) -> Any:
    """The choice's logprobs from text offset `offset`; `echoed`: this piece starts with
    the echoed prompt, whose tokens come first (the first one with a null logprob)."""
    if req.logprobs is None or c.logprobs is None:
        return None
    if not echoed:
        return completion_logprobs(c.token_ids, c.logprobs, req.logprobs, offset)
    prompt_ids = out.prompt_token_ids
    steps = list(out.prompt_logprobs or [None] * len(prompt_ids))
    return completion_logprobs(
        [*prompt_ids, *c.token_ids],
        [*steps, *c.logprobs],
        req.logprobs,
        offset,
        _decoder(tokenizer),
    )


def _failed(out: RequestOutput) -> None:
    """A request the engine ended with an error: 400 for a constraint it could not
    compile, 500 otherwise."""
    if out.error is None and all(c.finish_reason != "error" for c in out.outputs):
        return
    message = out.error or "the request failed in the engine"
    grammar = "grammar" in message or "schema" in message or "structured" in message
    raise APIError(
        400 if grammar else 500, message, param="structured_outputs" if grammar else None
    )


def _response(
    req: CompletionRequest,
    model_name: str,
    request_id: str,
    prompts: list[Prompt],
    finals: dict[int, RequestOutput],
    want_ids: bool,
    tokenizer: Any,
) -> CompletionResponse:
    choices: list[CompletionResponseChoice] = []
    completion_tokens = 0
    for i, prompt in enumerate(prompts):
        out = finals[i]
        _failed(out)
        echo = _echo(req, prompt, out, tokenizer)
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choices.append(
                CompletionResponseChoice(
                    index=i * req.n + c.index,
                    text=echo + c.text,
                    logprobs=_logprobs(req, out, c, 0, req.echo, tokenizer),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if want_ids else None,
                    prompt_token_ids=out.prompt_token_ids if want_ids else None,
                    prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
                )
            )
    num_prompt = sum(len(finals[i].prompt_token_ids) for i in range(len(prompts)))
    return CompletionResponse(
        id=request_id, model=model_name, choices=choices, usage=usage(num_prompt, completion_tokens)
    )


class _Stream:
    """One streaming completions response: its per-choice state and its chunks."""

    def __init__(
        self,
        req: CompletionRequest,
        model_name: str,
        request_id: str,
        prompts: list[Prompt],
        merger: OutputMerger,
        want_ids: bool,
        tokenizer: Any,
    ) -> None:
        self.req, self.model_name, self.request_id = req, model_name, request_id
        self.tokenizer = tokenizer
        self.prompts, self.merger = prompts, merger
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}
        self.num_tokens: dict[int, int] = {}
        self.num_prompt: dict[int, int] = {}
        self.want_ids = want_ids
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)

    async def chunks(self) -> AsyncIterator[str]:
        try:
            async for i, out in self.merger:
                self.num_prompt[i] = len(out.prompt_token_ids)
                for c in out.outputs:
                    if c.finish_reason == "error":
                        raise APIError(500, out.error or "the request failed in the engine")
                    yield self._chunk(i, out, c).model_dump_json()
            if self.include_usage:
                yield self._usage_chunk()
        finally:
            self.merger.close()

    def _chunk(self, i: int, out: RequestOutput, c: CompletionOutput) -> CompletionStreamResponse:
        index = i * self.req.n + c.index
        first = index not in self.offsets
        echoed = first and self.req.echo
        echo = _echo(self.req, self.prompts[i], out, self.tokenizer) if echoed else ""
        text = echo + c.text
        offset = self.offsets.get(index, 0)
        start = offset if echoed else offset + len(echo)
        logprobs = _logprobs(self.req, out, c, start, echoed, self.tokenizer)
        self.offsets[index] = offset + len(text)
        self.num_tokens[index] = self.num_tokens.get(index, 0) + len(c.token_ids)
        choice = CompletionResponseStreamChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=c.token_ids if self.want_ids else None,
            prompt_token_ids=out.prompt_token_ids if self.want_ids and first else None,
        )
        chunk = CompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model_name, choices=[choice]
        )
        if self.continuous:
            chunk.usage = self._usage()
        return chunk

    def _usage(self) -> UsageInfo:
        return usage(sum(self.num_prompt.values()), sum(self.num_tokens.values()))

    def _usage_chunk(self) -> str:
        chunk = CompletionStreamResponse(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=[],
            usage=self._usage(),
        )
        return chunk.model_dump_json(exclude_none=True)
