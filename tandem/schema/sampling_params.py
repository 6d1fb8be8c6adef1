"""Per-request sampling parameters, validated at the API boundary.

`SamplingParams` is a pydantic model so that a bad value is rejected before the request
reaches the engine, with one line per problem naming the field and the expected value
(`SamplingParams: temperature: expected a number >= 0 (got -1)`). Unknown fields are errors
(a misspelt option must not be silently ignored) and suggest the closest field name. The
constructor raises `SamplingParamsError` (a `ValueError`), never pydantic's own error. The
names and meanings follow vLLM's `SamplingParams`.

What depends on the model (token ids inside the vocabulary, `logprobs` against the
engine's cap) is checked by `validate_for_model` when the request enters the engine.
(`format_validation_error`, which writes pydantic's errors as those lines, is in
`validation_errors.py` and re-exported here.)
"""

from __future__ import annotations

import enum
import operator
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.schema.validation_errors import format_validation_error

__all__ = [
    "DEFAULT_MAX_LOGPROBS",
    "MAX_LOGIT_BIAS",
    "MAX_N",
    "SAMPLING_EPS",
    "SEED_MAX",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingParamsError",
    "TokenId",
    "format_validation_error",
    "num_logprobs",
    "validate_for_model",
]


#: Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`).
SAMPLING_EPS = 1e-5
#: vLLM's default cap on `logprobs` and `prompt_logprobs` (its `max_logprobs`).
DEFAULT_MAX_LOGPROBS = 20
#: The largest `n` a request may ask for: n sequences are n requests in the engine, and an
#: uncapped n lets one request exhaust memory before anything runs.
MAX_N = 1024
#: Seeds are unsigned 64-bit integers: `0 <= seed <= SEED_MAX`.
SEED_MAX = 2**64 - 1
#: The largest `|logit_bias|` (vLLM and OpenAI: [-100, 100]).
MAX_LOGIT_BIAS = 100.0


class SamplingParamsError(ValueError):
    """Raised for invalid sampling parameters; one line per problem, naming the field."""


class RequestOutputKind(enum.IntEnum):
    """What each streamed `RequestOutput` carries (vLLM's `RequestOutputKind`).

    CUMULATIVE: everything generated so far; DELTA: only what is new since the last
    output; FINAL_ONLY: one output when the request finishes. Offline `LLM.generate`
    returns the complete final output whatever the kind.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _exact_int(value: Any) -> Any:
    """An integer token id: ints (and numpy/torch integers) pass, floats and bools do not
    (3.0 or 3.7 must not be truncated to a token id)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"expected an integer token id (got {value!r})")
    return operator.index(value)


#: A token id given as an integer (no float, no bool), >= 0; the upper bound is the model's
#: vocabulary (`validate_for_model`).
TokenId = Annotated[int, BeforeValidator(_exact_int), Field(ge=0)]


class SamplingParams(BaseModel):
    """How to sample one request's output tokens.

    Invariants after validation: `1 <= n <= MAX_N`, `max_tokens >= 1`,
    `0 <= min_tokens <= max_tokens`, `0 < top_p <= 1`, `top_k == -1 or top_k >= 1`,
    `temperature` finite and >= 0 (below `SAMPLING_EPS` means greedy), every float finite,
    `seed` in [0, 2**64 - 1] or None, `stop` a list of non-empty strings, token ids
    integers >= 0, each `bad_words_token_ids` entry non-empty, `allowed_token_ids` None or
    non-empty, `logit_bias` values in [-100, 100], `logprobs` and `prompt_logprobs` None or
    >= -1 (-1: the whole vocabulary), `truncate_prompt_tokens` None, -1 or >= 1, and no
    `stop` strings when `detokenize` is False.
    """

    model_config = ConfigDict(
        extra="forbid", frozen=False, validate_assignment=True, allow_inf_nan=False
    )

    n: int = Field(
        1, ge=1, le=MAX_N, description=f"number of output sequences per prompt, 1..{MAX_N}"
    )
    temperature: float = Field(
        1.0, ge=0.0, description=f"finite, >= 0; below {SAMPLING_EPS} means greedy decoding"
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass, in (0, 1]")
    top_k: int = Field(-1, description="-1 (or 0) disables top-k; otherwise >= 1")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(
        None,
        description="per-request seed for reproducible sampling: an integer in "
        "[0, 2**64 - 1]; with n > 1, sequence j uses (seed + j) mod 2**64",
    )
    max_tokens: int = Field(16, ge=1, description="maximum number of output tokens")
    min_tokens: int = Field(0, ge=0, description="EOS and stop tokens are ignored before this many")
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logprobs: int | None = Field(
        None,
        ge=-1,
        description="number of top logprobs to return per output token, besides the sampled "
        "one; -1: the whole vocabulary",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=-1,
        description="number of top logprobs to return per prompt token, besides the prompt "
        "token itself; -1: the whole vocabulary",
    )
    bad_words: list[str] = Field(default_factory=list)
    #: Token sequences of `bad_words`, filled in by the front door's tokenizer (or given
    #: directly when there is no tokenizer).
    bad_words_token_ids: list[list[TokenId]] = Field(default_factory=list)
    #: Token id -> bias added to its logit before anything else (vLLM's `logit_bias`).
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | (
        None
    ) = None
    #: Only these tokens may be sampled (all others are masked); None: every token.
    allowed_token_ids: list[TokenId] | None = None
    #: The output constraint (vLLM's shape); a dict is validated into the model.
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    #: False: no text at all (`text == ""`, no decoded tokens in logprobs); token ids only.
    detokenize: bool = True
    #: Keep only the last k prompt tokens; -1: the last `max_model_len - 1` (one position
    #: is left for output).
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __init__(self, /, **data: Any) -> None:
        """Validate `data`; raise `SamplingParamsError` with one line per problem."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise SamplingParamsError(
                format_validation_error(exc, "SamplingParams", model=SamplingParams)
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise SamplingParamsError(
                format_validation_error(exc, "SamplingParams", model=SamplingParams)
            ) from None

    @field_validator("top_k")
    @classmethod
    def _top_k_valid(cls, value: int) -> int:
        if value == 0:
            return -1
        if value < -1:
            raise ValueError(f"expected -1 (disabled) or an integer >= 1 (got {value})")
        return value

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= SEED_MAX:
            raise ValueError(f"expected an integer in [0, 2**64 - 1] (got {value})")
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
            raise ValueError("expected non-empty stop strings")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words_non_empty_strings(cls, value: list[str]) -> list[str]:
        for i, word in enumerate(value):
            if not word:
                raise ValueError(f"expected non-empty words (got '' at index {i})")
        return value

    @field_validator("stop_token_ids", "bad_words_token_ids", "bad_words", mode="before")
    @classmethod
    def _none_as_empty(cls, value: Any) -> Any:
        return value if value is not None else []

    @field_validator("bad_words_token_ids")
    @classmethod
    def _bad_words_non_empty(cls, value: list[list[int]]) -> list[list[int]]:
        for i, word in enumerate(value):
            if not word:
                raise ValueError(f"expected non-empty token id lists (got [] at index {i})")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_non_empty(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not value:
            raise ValueError("expected a non-empty list of token ids, or None (got [])")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _json_keys(cls, value: Any) -> Any:
        """JSON object keys are strings: accept `{"50256": -100}` as vLLM's server does."""
        if isinstance(value, dict):
            return {
                int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k: v
                for k, v in value.items()
            }
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_valid(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError(f"expected an integer >= 1, or -1 for max_model_len (got {value})")
        return value

    @field_validator("output_kind", mode="before")
    @classmethod
    def _output_kind_by_name(cls, value: Any) -> Any:
        if isinstance(value, str) and value.upper() in RequestOutputKind.__members__:
            return RequestOutputKind[value.upper()]
        if isinstance(value, RequestOutputKind) or (
            isinstance(value, int) and value in set(RequestOutputKind)
        ):
            return RequestOutputKind(value)
        names = ", ".join(kind.name for kind in RequestOutputKind)
        raise ValueError(f"expected one of {names} (got {value!r})")

    @model_validator(mode="after")
    def _cross_field(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: expected at most max_tokens ({self.max_tokens}) "
                f"(got {self.min_tokens})"
            )
        if self.stop and not self.detokenize:
            raise ValueError("stop: stop strings need detokenize=True (got detokenize=False)")
        return self

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temperature below `SAMPLING_EPS` (as vLLM)."""
        return self.temperature < SAMPLING_EPS

    @classmethod
    def build(cls, **kwargs: Any) -> SamplingParams:
        """Construct; same as `SamplingParams(**kwargs)` (raises `SamplingParamsError`)."""
        return cls(**kwargs)

    def child(self, j: int) -> SamplingParams:
        """The parameters of sequence j of an `n > 1` request: n=1, seed (seed + j) mod
        2**64 (unseeded stays unseeded)."""
        seed = None if self.seed is None else (self.seed + j) % (SEED_MAX + 1)
        return self.model_copy(update={"n": 1, "seed": seed})


def validate_for_model(
    params: SamplingParams, vocab_size: int | None, max_logprobs: int = DEFAULT_MAX_LOGPROBS
) -> None:
    """Check what depends on the model and the engine; raise `SamplingParamsError` naming
    the field and the expected value (one line).

    Token ids (`stop_token_ids`, `bad_words_token_ids`, `allowed_token_ids`, `logit_bias`
    keys) must lie in [0, vocab_size); `logprobs` and `prompt_logprobs` (-1 counts as
    vocab_size, as in vLLM) must be <= `max_logprobs` (-1: no cap) and <= vocab_size.
    `vocab_size` None skips the vocabulary checks.
    """
    if vocab_size is not None:
        token_lists: list[tuple[str, list[int]]] = [
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("logit_bias", list(params.logit_bias or ())),
        ]
        token_lists += [
            (f"bad_words_token_ids.{i}", word) for i, word in enumerate(params.bad_words_token_ids)
        ]
        for name, ids in token_lists:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(
                    f"SamplingParams: {name}: expected token ids in [0, {vocab_size}) "
                    f"(got {bad[0]})"
                )
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is None:
            continue
        num = vocab_size if asked == -1 else asked
        if max_logprobs != -1 and (num is None or num > max_logprobs):
            shown = "-1 (the whole vocabulary)" if asked == -1 else str(asked)
            raise SamplingParamsError(
                f"SamplingParams: {name}: expected at most {max_logprobs} (the engine's "
                f"max_logprobs) (got {shown})"
            )
        if vocab_size is not None and num is not None and num > vocab_size:
            raise SamplingParamsError(
                f"SamplingParams: {name}: expected at most the vocabulary size "
                f"{vocab_size} (got {asked})"
            )


def num_logprobs(asked: int | None, vocab_size: int) -> int | None:
    """The number of top logprobs to compute for `logprobs`/`prompt_logprobs` (-1: all)."""
    if asked is None:
        return None
    return vocab_size if asked == -1 else min(asked, vocab_size)
