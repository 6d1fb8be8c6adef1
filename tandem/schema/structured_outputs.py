"""The request side of structured output: what a request's output must match.

`StructuredOutputsParams` has vLLM's shape: exactly one of `json` (a JSON schema as a dict,
a JSON string, or a pydantic model class), `regex`, `grammar` (EBNF/GBNF text),
`choice` (a list of strings) or `json_object: true`; plus an optional `backend` name
(`xgrammar` | `outlines`). `custom` carries an opaque spec for a third-party grammar plugin
(the bundled backends refuse it).

Only the *shape* is checked here (exactly one constraint, types, a JSON string that
parses, a non-empty choice list): the kernel must not import any grammar backend. Whether
a backend supports the constraint (EBNF on outlines-core, a regex feature, a backend name)
is checked by the grammar plugin when the request enters the engine (`add_request`), and
compile errors are reported for that request only.

Invariant after validation: exactly one constraint field is set, and `json` is a dict or a
string holding a JSON object (a pydantic model class has become its JSON schema).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator
from pydantic.dataclasses import dataclass

#: The constraint fields; exactly one must be set.
CONSTRAINT_FIELDS = ("json", "regex", "grammar", "choice", "json_object", "custom")


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class StructuredOutputsParams:
    """One request's output constraint (vLLM's `StructuredOutputsParams`, a dataclass as
    there). Construct it directly or pass a dict wherever `SamplingParams` takes one."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    custom: dict[str, Any] | None = None
    backend: str | None = None

    @field_validator("json", mode="before")
    @classmethod
    def _schema_from_model(cls, value: Any) -> Any:
        if isinstance(value, type) and issubclass(value, BaseModel):
            return value.model_json_schema()
        return value

    @field_validator("json")
    @classmethod
    def _json_string_parses(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a valid JSON schema string: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError(f"a JSON schema must be an object, got {type(value).__name__}")
        return value

    @field_validator("choice")
    @classmethod
    def _choice_non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or any(c == "" for c in value)):
            raise ValueError("must be a non-empty list of non-empty strings")
        return value

    @field_validator("json_object")
    @classmethod
    def _json_object_true(cls, value: bool | None) -> bool | None:
        if value is False:
            return None
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            names = ", ".join(CONSTRAINT_FIELDS)
            got = ", ".join(given) if given else "none"
            raise ValueError(f"exactly one of {names} must be set (got {got})")
        return self

    @property
    def kind(self) -> str:
        """The name of the constraint field that is set."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None)

    def spec_key(self) -> str:
        """A canonical string of the constraint (not the backend): the compile-cache key."""
        value = getattr(self, self.kind)
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))
