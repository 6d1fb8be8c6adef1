"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server reports goes through `APIError` (status, message, type, param) or
is converted to one here: pydantic's `ValidationError` (400, `param` is the field's path,
`messages.0.content`), tandem's `ValueError`s whose message starts with the field
(`SamplingParams: temperature: ...`, `prompt: ...`, 400), the engine's `QueueFullError`
(429 with `Retry-After`), `EngineDeadError` (500, type `EngineDeadError`) and
`StreamOverflowError` (500). `code` is the HTTP status, as vLLM's server sets it.
"""

from __future__ import annotations

import math
import re
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from tandem.engine.errors import EngineDeadError, QueueFullError, StreamOverflowError

#: Error `type` per status (the names the `openai` client gives its exceptions).
TYPE_OF_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

#: A tandem message that names its field: `where: field.path: ...` or `field: ...`.
_FIELD_RE = re.compile(r"^(?:(?:SamplingParams|request \S+|structured_outputs):\s*)?([\w.\[\]']+):")


class APIError(Exception):
    """An error answered with an OpenAI-style body; `headers` are added to the response."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or TYPE_OF_STATUS.get(status) or HTTPStatus(status).phrase
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_validation_error(exc: ValidationError) -> APIError:
    """400 naming the first bad field (pydantic's `loc`), every problem in the message."""
    errors = exc.errors(include_url=False)
    lines, first = [], None
    for err in errors:
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
        first = first or loc or None
        msg = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return bad_request("; ".join(lines), param=first)


def _is_union_tag(part: Any) -> bool:
    """pydantic puts the union member's type in `loc` (`list[int]`, `str`); not a field."""
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "float", "bool", "function-after[...]")
    )


def from_value_error(exc: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """400 for tandem's ValueErrors; `param` is the field the message starts with, renamed
    to the request's own name (`logprobs` -> `top_logprobs` for chat) by `renames`."""
    message = "; ".join(str(exc).splitlines()) or type(exc).__name__
    message = message.removeprefix("SamplingParams: ")
    match = _FIELD_RE.match(message)
    param = match.group(1) if match else None
    if param is not None and renames:
        head = param.split(".")[0]
        param = renames.get(head, head) + param[len(head) :]
    return bad_request(message, param=param)


def from_exception(exc: BaseException, renames: dict[str, str] | None = None) -> APIError:
    """The `APIError` answering `exc` (engine errors, validation errors, anything else)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        retry = str(max(1, math.ceil(getattr(exc, "retry_after_s", 1) or 1)))
        return APIError(429, str(exc), param=None, headers={"Retry-After": retry})
    if isinstance(exc, EngineDeadError):
        return APIError(500, f"the engine died: {exc}", err_type="EngineDeadError")
    if isinstance(exc, StreamOverflowError):
        return APIError(500, str(exc), err_type="StreamOverflowError")
    if isinstance(exc, ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, (ValueError, TypeError)):
        return from_value_error(ValueError(str(exc)), renames)
    return APIError(500, f"{type(exc).__name__}: {exc}", err_type="InternalServerError")
