"""POST /v1/chat/completions (vLLM's `OpenAIServingChat`).

The conversation goes through the tokenizer's chat template (`tandem.chat_prompts`, as
`LLM.chat`); message content given as a list of parts has its text parts joined with
newlines (vLLM's "string" content format). A model without a tokenizer cannot chat: 400
naming `messages`. Streaming, each choice's first chunk is `delta: {"role": "assistant",
"content": ""}`, then one chunk per new piece of text, the last one with `finish_reason`;
`stream_options.include_usage` adds a chunk with `choices: []` and `usage`. Chunks leave
out unset fields, as vLLM's do.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from tandem.chat_prompts import chat_prompts
from tandem.schema.outputs import CompletionOutput, RequestOutput
from tandem.server.errors import APIError, bad_request
from tandem.server.logprobs import chat_logprobs, prompt_logprobs_json
from tandem.server.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    usage,
)
from tandem.server.serving_common import (
    OutputMerger,
    Prompt,
    prompt_len,
    random_id,
    run_blocking,
    with_bad_words,
)
from tandem.server.to_sampling_params import (
    chat_max_tokens_field,
    chat_sampling_params,
    max_tokens_for,
)
from tandem.server.tool_calls import ToolCallDeltas, tool_message
from tandem.server.tool_choice import (
    ToolPlan,
    ToolServing,
    plan_tools,
    template_messages,
    warn_if_template_ignores_tools,
)


def _flatten(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with list content (parts) as one string of their text parts."""
    flat = []
    for m, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for p, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    where = f"messages.{m}.content.{p}"
                    raise bad_request(f"{where}: only text parts are supported", param=where)
                texts.append(str(part.get("text", "")))
            message = {**message, "content": "\n".join(texts)}
        elif content is None and "content" in message:
            message = {**message, "content": ""}
        flat.append(message)
    return flat


def render_chat(
    engine: Any,
    messages: list[dict[str, Any]],
    req: Any,
    tools: list[dict[str, Any]] | None = None,
) -> Prompt:
    """The conversation as one prompt through the chat template (`tools`, when given, as
    the template's `tools` variable); 400 naming the field."""
    if engine.tokenizer is None:
        raise bad_request(
            "messages: chat needs a tokenizer with a chat template; this model has none "
            "(use /v1/completions with token-id prompts)",
            param="messages",
        )
    if not messages:
        raise bad_request("messages: expected at least one message", param="messages")
    try:
        if tools:
            warn_if_template_ignores_tools(req.chat_template or engine.tokenizer.chat_template)
        rendered = chat_prompts(
            engine.tokenizer,
            _flatten(template_messages(messages)),
            req.chat_template,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            allow_path=False,  # a request's template is text, never a file to read
            tools=tools,
        )[0]
    except APIError:
        raise
    except Exception as exc:  # template errors (jinja's, the template's own raise_exception)
        message = str(exc).replace("messages[0]", "messages")
        field = message.split(":")[0] if ":" in message else "messages"
        raise bad_request(message, param=field if " " not in field else "messages") from None
    return Prompt(rendered["prompt"], rendered["prompt_token_ids"])


class OpenAIServingChat:
    """Answers chat completions requests on one `AsyncLLM`."""

    def __init__(self, engine: Any, tools: ToolServing | None = None) -> None:
        self.engine = engine
        self.tools = tools or ToolServing()

    async def create(self, req: ChatCompletionRequest, model_name: str) -> dict[str, Any] | Any:
        """The response body (a dict), or an async iterator of JSON chunks when streaming.
        Raises `APIError` (or an engine error) before any output when refused."""
        plan = plan_tools(req, self.tools)
        prompt = await run_blocking(
            render_chat, self.engine, req.messages, req, plan.template_tools
        )
        defaults = self.engine.get_default_sampling_params()
        max_len = self.engine.max_model_len
        asked, field = chat_max_tokens_field(req)
        length = prompt_len(prompt, req.truncate_prompt_tokens, max_len)
        budget = max_tokens_for(asked, length, max_len, defaults, field)
        params = await with_bad_words(
            self.engine, chat_sampling_params(req, budget, defaults, field)
        )
        request_id = req.request_id or random_id("chatcmpl")
        gen = self.engine.generate(
            prompt.as_engine_prompt(), params, request_id, priority=req.priority
        )
        merger = OutputMerger([gen])
        await merger.start()
        if req.stream:
            return _ChatStream(req, model_name, request_id, merger, plan).chunks()
        final: RequestOutput | None = None
        try:
            async for _, out in merger:
                final = out
        finally:
            merger.close()
        assert final is not None
        return _response(req, model_name, request_id, final, plan).model_dump(exclude_none=False)


def _check_failed(out: RequestOutput, plan: ToolPlan) -> None:
    if out.error is None and all(c.finish_reason != "error" for c in out.outputs):
        return
    message = out.error or "the request failed in the engine"
    grammar = any(word in message for word in ("grammar", "schema", "structured"))
    field = "tools" if plan.constrained else "response_format"
    raise APIError(400 if grammar else 500, message, param=field if grammar else None)


def _logprobs(req: ChatCompletionRequest, c: CompletionOutput) -> ChatCompletionLogProbs | None:
    if not req.logprobs or c.logprobs is None:
        return None
    return chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)


def _response(
    req: ChatCompletionRequest,
    model_name: str,
    request_id: str,
    out: RequestOutput,
    plan: ToolPlan,
) -> ChatCompletionResponse:
    _check_failed(out, plan)
    choices = []
    for c in out.outputs:
        content, tool_calls, finish_reason = tool_message(plan, c.text, c.finish_reason)
        choices.append(
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatMessage(role="assistant", content=content, tool_calls=tool_calls),
                logprobs=_logprobs(req, c),
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if req.return_token_ids else None,
            )
        )
    num_output = sum(len(c.token_ids) for c in out.outputs)
    return ChatCompletionResponse(
        id=request_id,
        model=model_name,
        choices=choices,
        usage=usage(len(out.prompt_token_ids), num_output),
        prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None,
        prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
    )


class _ChatStream:
    """One streaming chat response: role chunks, content chunks, the usage chunk."""

    def __init__(
        self,
        req: ChatCompletionRequest,
        model_name: str,
        request_id: str,
        merger: OutputMerger,
        plan: ToolPlan,
    ) -> None:
        self.req, self.model_name, self.request_id, self.merger = (
            req,
            model_name,
            request_id,
            merger,
        )
        self.tool_deltas = {j: ToolCallDeltas(plan) for j in range(req.n)}
        self.created = int(time.time())
        self.num_tokens = 0
        self.num_prompt = 0
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous = bool(opts and opts.include_usage and opts.continuous_usage_stats)

    def _dump(self, choices: list[ChatCompletionResponseStreamChoice], **extra: Any) -> str:
        chunk = ChatCompletionStreamResponse(
            id=self.request_id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.model_name,
            choices=choices,
            **extra,
        )
        if self.continuous and choices:
            chunk.usage = usage(self.num_prompt, self.num_tokens)
        return chunk.model_dump_json(exclude_unset=True)

    async def chunks(self) -> AsyncIterator[str]:
        try:
            for j in range(self.req.n):
                role = DeltaMessage(role="assistant", content="")
                choice = ChatCompletionResponseStreamChoice(
                    index=j, delta=role, logprobs=None, finish_reason=None
                )
                yield self._dump([choice])
            async for _, out in self.merger:
                self.num_prompt = len(out.prompt_token_ids)
                for c in out.outputs:
                    if c.finish_reason == "error":
                        raise APIError(500, out.error or "the request failed in the engine")
                    self.num_tokens += len(c.token_ids)
                    choice = self._choice(c)
                    if choice is not None:
                        yield self._dump([choice])
            if self.include_usage:
                yield self._dump([], usage=usage(self.num_prompt, self.num_tokens))
        finally:
            self.merger.close()

    def _choice(self, c: CompletionOutput) -> ChatCompletionResponseStreamChoice | None:
        """The chunk's choice for output `c`; None when it has nothing to send (text a
        tool parser holds back, with no finish, logprobs or token ids)."""
        delta = DeltaMessage(content=c.text)
        finish_reason = c.finish_reason
        tools = self.tool_deltas[c.index]
        if tools.active:
            content, calls = tools.delta(c.text, c.finish_reason is not None)
            fields: dict[str, Any] = {"content": content} if content else {}
            delta = DeltaMessage(**fields, **({"tool_calls": calls} if calls else {}))
            finish_reason = tools.finish_reason(c.finish_reason)
            quiet = not (fields or calls or finish_reason or self.req.return_token_ids)
            if quiet and not (self.req.logprobs and c.logprobs):
                return None
        choice = ChatCompletionResponseStreamChoice(
            index=c.index,
            delta=delta,
            logprobs=_logprobs(self.req, c),
            finish_reason=finish_reason,
        )
        if c.finish_reason is not None:
            choice.stop_reason = c.stop_reason
        if self.req.return_token_ids:
            choice.token_ids = c.token_ids
        return choice
