"""What a request must satisfy against the model before an engine takes it.

`check_request` is the front door's rule book; the engine calls it once, in `add_request`,
so every way in (LLM, the CLI, an engine built directly) is checked the same. The prompt is a
non-empty list of integer token ids inside the vocabulary, shorter than `max_model_len` (one
position is left for output), and the sampling parameters are ones the model can honour
(`validate_for_model`); a constrained request needs a grammar backend in the stack. Each
message names the request and the field.
"""

from __future__ import annotations

from typing import Protocol

from tandem.schema.config import EngineConfig
from tandem.schema.diffusion_config import diffusion_request_problems
from tandem.schema.sampling_params import SamplingParams, SamplingParamsError, validate_for_model


class RequestRejectedError(ValueError):
    """A plugin refused one request for a reason of its own (a schema its grammar backend
    cannot compile, an unknown backend name). Front doors report it to that request only,
    as `finish_reason == "error"`, and go on with the other requests."""


class CheckedRequest(Protocol):
    """What `check_request` reads of a request (the kernel's `Request` has it all)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def use_structured_output(self) -> bool: ...


def check_request(request: CheckedRequest, config: EngineConfig, has_grammar_backend: bool) -> None:
    """Raise TypeError or ValueError (`SamplingParamsError` for the parameters,
    `RequestRejectedError` for a constrained request on a stack with no grammar backend)
    for a request no step of an engine with this resolved `config` could run. A model of
    unknown vocabulary size (`model.vocab_size` None) skips the vocabulary checks."""
    rid = request.request_id
    vocab_size, max_model_len = config.model.vocab_size, config.max_model_len
    if not isinstance(request.sampling_params, SamplingParams):
        raise TypeError("sampling_params: expected a tandem.SamplingParams")
    n = request.num_prompt_tokens
    if n == 0:
        raise ValueError(f"request {rid}: prompt: must not be empty")
    if n >= max_model_len:
        raise ValueError(
            f"request {rid}: prompt: {n} tokens is too long; max_model_len is "
            f"{max_model_len} and at least one position must be left for output"
        )
    ids = request.prompt_token_ids
    if not all(isinstance(t, int) for t in ids):
        raise ValueError(f"request {rid}: prompt_token_ids: expected integers")
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise ValueError(
            f"request {rid}: prompt_token_ids: token id {bad} is outside the vocabulary "
            f"[0, {vocab_size})"
        )
    validate_for_model(request.sampling_params, vocab_size, config.model.max_logprobs)
    if config.diffusion is not None:  # issue 15 (additive): fields a diffusion model refuses
        problems = diffusion_request_problems(request.sampling_params)
        if problems:
            raise SamplingParamsError(f"request {rid}: {problems[0]}")
    if request.use_structured_output and not has_grammar_backend:
        raise RequestRejectedError(
            f"request {rid}: structured_outputs: this engine's stack has no grammar backend "
            "(the scripted model has no tokenizer; with a real model add the "
            "'structured-output' plugin)"
        )
