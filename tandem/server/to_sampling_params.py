"""An OpenAI request's fields as a `tandem.SamplingParams` (vLLM's `to_sampling_params`).

Unset sampling fields take the model's defaults (`engine.get_default_sampling_params()`,
from `generation_config.json` as vLLM does), then `SamplingParams`' own. `max_tokens` is
the request's (chat: `max_completion_tokens`, else the deprecated `max_tokens`), else what
the context leaves (`max_model_len - prompt tokens`), capped by the model's default when
it sets one. As in vLLM, only an explicit `max_tokens` that does not fit the context is a
400: a completions request that leaves `max_tokens` out gets OpenAI's default 16 *clamped
to the room left*, and `max_tokens: null` gets the room left, so a 511-token prompt on a
512-token model runs one token either way. The output constraint comes from `response_format` (`json_schema`,
`json_object`), vLLM's `structured_outputs` body, its older `guided_*` fields, or a chat
request's `tool_choice` (`required` or a named function: `tool_choice.tool_call_schema`);
more than one is a 400. `prompt_logprobs` (not with streaming, as in vLLM) is the
request's, or with completions' `echo` and `logprobs` the `logprobs` count. Errors are
`APIError`s naming the request's field.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tandem.schema.sampling_params import RequestOutputKind, SamplingParams
from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.server.errors import bad_request, from_validation_error, from_value_error
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tandem.server.tool_choice import tool_call_schema

#: Fields unset in the request that take the model's default when it has one.
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_ZEROED = ("presence_penalty", "frequency_penalty")

#: SamplingParams field -> the chat request's name for it (for error messages).
CHAT_RENAMES = {"logprobs": "top_logprobs"}


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, or None; 400 naming the field when it is bad or
    when more than one way of giving it is used."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.json_schema if fmt.json_schema else None
        if schema is None:
            raise bad_request(
                "response_format: type 'json_schema' needs json_schema.schema",
                param="response_format.json_schema",
            )
        given.append(("response_format", {"json": schema}))
    elif fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    guided = {
        "json": req.guided_json,
        "regex": req.guided_regex,
        "choice": req.guided_choice,
        "grammar": req.guided_grammar,
    }
    for kind, value in guided.items():
        if value is not None:
            given.append((f"guided_{kind}", {kind: value}))
    tool_schema = tool_call_schema(req) if isinstance(req, ChatCompletionRequest) else None
    if tool_schema is not None:  # `tool_choice` required or named (tandem.server.tool_choice)
        given.insert(0, ("tool_choice", {"json": tool_schema}))
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"{given[1][0]}: give one output constraint, got {names}", given[1][0])
    name, spec = given[0]
    try:
        return StructuredOutputsParams(**spec)
    except ValidationError as exc:
        err = from_validation_error(exc)
        raise bad_request(f"{name}: {err.message}", param=name) from None
    except TypeError as exc:
        raise bad_request(f"{name}: {exc}", param=name) from None


def _common(req: SamplingFields, defaults: SamplingParams) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options: only with stream=true", param="stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request(
            "prompt_logprobs: not available with stream=true (as in vLLM)",
            param="prompt_logprobs",
        )
    fields: dict[str, Any] = {}
    for name in _DEFAULTED:
        value = getattr(req, name)
        fields[name] = getattr(defaults, name) if value is None else value
    for name in _ZEROED:
        value = getattr(req, name)
        fields[name] = 0.0 if value is None else value
    fields.update(
        n=req.n,
        seed=req.seed,
        stop=req.stop or [],
        stop_token_ids=req.stop_token_ids or [],
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logit_bias=req.logit_bias,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words or [],
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        structured_outputs=structured_outputs(req),
        output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
    )
    return fields


def max_tokens_for(
    asked: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    defaults: SamplingParams,
    param: str,
    cap: int | None = None,
) -> int:
    """The output budget: `asked`, else what the context leaves capped by `cap` (the
    request's own default) or else by a model default that `generation_config.json` set;
    400 naming `param` when the prompt leaves no room or prompt + `asked` exceeds
    `max_model_len`."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(
            f"prompt: {num_prompt_tokens} tokens is too long; max_model_len is {max_model_len} "
            "and at least one position must be left for output",
            param="prompt",
        )
    if asked is None:
        default = defaults.max_tokens if "max_tokens" in defaults.model_fields_set else None
        default = cap if cap is not None else default
        return min(room, default) if default is not None else room
    if asked >= 1 and num_prompt_tokens + asked > max_model_len:
        raise bad_request(
            f"{param}: prompt ({num_prompt_tokens} tokens) + {param} ({asked}) = "
            f"{num_prompt_tokens + asked} exceeds max_model_len ({max_model_len}); reduce "
            f"the prompt or {param}",
            param=param,
        )
    return asked


def _build(fields: dict[str, Any], renames: dict[str, str] | None) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except ValueError as exc:  # SamplingParamsError: one line per bad field
        raise from_value_error(exc, renames) from None


def completion_max_tokens(req: CompletionRequest) -> tuple[int | None, int | None]:
    """(the `max_tokens` a completions request asked for, the cap when it asked for none):
    left out, OpenAI's default (the field's default, 16) is a cap on the room left, not a
    demand; given (a number or null), it is the request's."""
    if "max_tokens" in req.model_fields_set:
        return req.max_tokens, None
    return None, req.max_tokens


def completion_sampling_params(
    req: CompletionRequest, max_tokens: int, defaults: SamplingParams
) -> SamplingParams:
    """`SamplingParams` of a completions request whose output budget is `max_tokens`."""
    if req.suffix is not None:
        raise bad_request("suffix: not supported", param="suffix")
    fields = _common(req, defaults)
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs  # echoed prompt tokens carry logprobs too (vLLM)
    fields.update(max_tokens=max_tokens, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)
    return _build(fields, None)


def chat_sampling_params(
    req: ChatCompletionRequest, max_tokens: int, defaults: SamplingParams, max_tokens_param: str
) -> SamplingParams:
    """`SamplingParams` of a chat request; `top_logprobs` without `logprobs` is a 400.
    Errors name the request's fields (`top_logprobs`, `max_tokens_param`)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: needs logprobs=true", param="top_logprobs")
    fields = _common(req, defaults)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    fields.update(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs)
    return _build(fields, {**CHAT_RENAMES, "max_tokens": max_tokens_param})


def chat_max_tokens_field(req: ChatCompletionRequest) -> tuple[int | None, str]:
    """The chat request's output budget and the field that gave it."""
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"
