"""pydantic's `ValidationError` as one line per problem, naming the field.

`format_validation_error` writes `where: field.path: message (got value)` for each error
(`where:N` when a YAML file's key lines are known). Given the model class, pydantic's
messages become `expected ...` and an unknown field suggests the closest field name.
`SamplingParams` (its constructor's `SamplingParamsError`), the stack file loader and the
plugin options resolver report through it.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _expected(err: Any, model: type[BaseModel]) -> str:
    """pydantic's message for one error, rewritten as `expected ...` (one line)."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    bound = next((ctx[k] for k in ("ge", "gt", "le", "lt") if k in ctx), None)
    what = "a number" if isinstance(bound, float) else "an integer"
    comparisons = {
        "greater_than_equal": ">=",
        "greater_than": ">",
        "less_than_equal": "<=",
        "less_than": "<",
    }
    if kind in comparisons:
        return f"expected {what} {comparisons[kind]} {_number(bound)}"
    if kind == "extra_forbidden":
        name = str(err["loc"][-1]) if err["loc"] else "?"
        close = difflib.get_close_matches(name, list(model.model_fields), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown field {name!r}{hint}"
    plain = {
        "int_parsing": "expected an integer",
        "int_type": "expected an integer",
        "int_from_float": "expected an integer",
        "float_parsing": "expected a number",
        "float_type": "expected a number",
        "finite_number": "expected a finite number",
        "bool_parsing": "expected true or false",
        "bool_type": "expected true or false",
        "string_type": "expected a string",
        "list_type": "expected a list",
        "dict_type": "expected a mapping",
        "missing": "required",
    }
    if kind in plain:
        return plain[kind]
    if kind == "enum":
        return f"expected one of {ctx.get('expected')}"
    message = str(err["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    return message


def format_validation_error(
    exc: ValidationError,
    where: str,
    key_lines: dict[tuple[str | int, ...], int] | None = None,
    model: type[BaseModel] | None = None,
) -> str:
    """One line per problem: `where: field.path: message (got value)`; `where:N` when
    `key_lines` (from a YAML file) knows the field path's line. With `model`, messages are
    rewritten as `expected ...` and an unknown field suggests the closest field name."""
    lines = []
    for err in exc.errors():
        loc = err["loc"]
        if model is not None and loc and loc[-1] == "[key]":
            loc = loc[:-2]  # a bad mapping key: the field, with the key as the value
        path = ".".join(str(p) for p in loc)
        at = where
        if key_lines:
            from tandem.schema.config import with_line

            at = with_line(where, key_lines, tuple(err["loc"]))
        got = err.get("input")
        if model is not None:
            msg = _expected(err, model)
            shown = (
                ""
                if isinstance(got, dict) or "(got " in msg or err["type"] == "extra_forbidden"
                else f" (got {got!r})"
            )
            line = f"{at}: {path}: {msg}{shown}" if path else f"{at}: {msg}"
        else:
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            msg = str(err["msg"])
            if err["type"] == "extra_forbidden":
                msg = "unknown field"
            line = f"{at}: {path or '<root>'}: {msg}{shown}"
        lines.append(" ".join(line.splitlines()))
    return "\n".join(lines)
