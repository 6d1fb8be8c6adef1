"""Per-request sampling parameters, validated at the API boundary.

`SamplingParams` is a pydantic model so that a bad value is rejected before the request
reaches the engine, with a message that names the field and what was expected. Unknown
fields are errors (a misspelt option must not be silently ignored). The names and meanings
follow vLLM's `SamplingParams`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tandem.core.structured_outputs import StructuredOutputsParams


class SamplingParamsError(ValueError):
    """Raised for invalid sampling parameters; the message names each bad field."""


class SamplingParams(BaseModel):
    """How to sample one request's output tokens.

    Invariants after validation: `max_tokens >= 1`, `0 <= min_tokens <= max_tokens`,
    `0 < top_p <= 1`, `top_k == -1 or top_k >= 1`, `temperature >= 0` (0 means greedy),
    `stop` is a list of non-empty strings.
    """

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)

    n: int = Field(1, ge=1, description="number of output sequences per prompt")
    temperature: float = Field(1.0, ge=0.0, description="0 selects greedy decoding")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass, in (0, 1]")
    top_k: int = Field(-1, description="-1 (or 0) disables top-k; otherwise >= 1")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, description="per-request seed for reproducible sampling")
    max_tokens: int = Field(16, ge=1, description="maximum number of output tokens")
    min_tokens: int = Field(0, ge=0, description="EOS and stop tokens are ignored before this many")
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logprobs: int | None = Field(None, ge=0, description="number of top logprobs to return")
    bad_words: list[str] = Field(default_factory=list)
    #: Token sequences of `bad_words`, filled in by the front door's tokenizer (or given
    #: directly when there is no tokenizer).
    bad_words_token_ids: list[list[int]] = Field(default_factory=list)
    #: The output constraint (vLLM's shape); a dict is validated into the model.
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True

    @field_validator("top_k")
    @classmethod
    def _top_k_valid(cls, value: int) -> int:
        if value == 0:
            return -1
        if value < -1:
            raise ValueError("must be -1 (disabled) or a positive integer")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        return value if value is not None else []

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids_as_list(cls, value: Any) -> Any:
        return value if value is not None else []

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def build(cls, **kwargs: Any) -> SamplingParams:
        """Construct and turn pydantic's error into a `SamplingParamsError` naming each field."""
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            raise SamplingParamsError(format_validation_error(exc, "SamplingParams")) from exc


def format_validation_error(
    exc: ValidationError, where: str, key_lines: dict[tuple[str | int, ...], int] | None = None
) -> str:
    """One line per problem: `where: field.path: message (got value)`; `where:N` when
    `key_lines` (from a YAML file) knows the field path's line."""
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "<root>"
        at = where
        if key_lines:
            from tandem.core.config import with_line

            at = with_line(where, key_lines, tuple(err["loc"]))
        got = err.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{at}: {path}: {msg}{shown}")
    return "\n".join(lines)
