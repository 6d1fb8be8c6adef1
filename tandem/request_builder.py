"""From a user's prompt and parameters to the engine's `Request`, the same for every front
door (`LLM`, `AsyncLLM`, the server).

A prompt is a string (tokenised with the model's tokenizer), a list of integer token ids or
a dict with `prompt` or `prompt_token_ids`; errors name where it was given (`prompts[3]`,
`prompt`). `bad_words` are tokenised (each word as written and with a leading space) and the
prompt is cut to its last `truncate_prompt_tokens` tokens (-1: `max_model_len - 1`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.core.request import Request
from tandem.llm_inputs import PromptType, _token_ids
from tandem.schema.config import EngineConfig
from tandem.schema.sampling_params import SamplingParams


def bad_words_token_ids(
    tokenizer: Any, words: Sequence[str], given: Sequence[Sequence[int]] = ()
) -> list[list[int]]:
    """The token sequences to ban for `words`: `given` first, then each word as written and
    with one leading space (vLLM's two variants), each distinct sequence once, in order.
    Linear in the number of words (a set of tuples remembers what is already there); the
    variants are tokenised in one batched call."""
    sequences = [list(ids) for ids in given]
    seen = {tuple(ids) for ids in sequences}
    variants = [v for word in words for v in (word, " " + word.lstrip())]
    if not variants:
        return sequences
    # one batched call: a fast tokenizer encodes the batch outside the GIL
    for ids in tokenizer(variants, add_special_tokens=False)["input_ids"]:
        key = tuple(ids)
        if key and key not in seen:
            seen.add(key)
            sequences.append(list(ids))
    return sequences


def resolve_bad_words(tokenizer: Any, params: SamplingParams) -> SamplingParams:
    """`params` with its `bad_words` tokenised into `bad_words_token_ids` and the words
    cleared, so building the request does not tokenise them again (the server does this
    in a worker thread, off its event loop)."""
    if not params.bad_words:
        return params
    sequences = bad_words_token_ids(tokenizer, params.bad_words, params.bad_words_token_ids)
    return params.model_copy(update={"bad_words_token_ids": sequences, "bad_words": []})


class RequestBuilder:
    """Turns prompts into token ids and (id, tokens, params) into a `Request`."""

    def __init__(self, config: EngineConfig, tokenizer: Any | None) -> None:
        self.config = config
        self.tokenizer = tokenizer

    def prompt_token_ids(self, prompt: PromptType, where: str) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt; `where` names it in errors."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = _token_ids(prompt["prompt_token_ids"], f"{where}['prompt_token_ids']")
                return prompt.get("prompt"), ids
            if "prompt" not in prompt:
                raise ValueError(
                    f"{where}: expected a dict with 'prompt' or 'prompt_token_ids', got "
                    f"keys {sorted(map(str, prompt))}"
                )
            prompt, where = prompt["prompt"], f"{where}['prompt']"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{where}: text prompts need a tokenizer; this model has none, pass token ids"
                )
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise ValueError(f"{where}: the prompt is empty (no tokens)")
            return prompt, ids
        return None, _token_ids(prompt, where)

    def _bad_words_token_ids(self, params: SamplingParams) -> SamplingParams:
        if not params.bad_words or self.tokenizer is None:
            return params
        return resolve_bad_words(self.tokenizer, params)

    def build(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Request:
        """The engine's request (not yet validated against the model: the engine does
        that in `add_request`). Stop strings and bad words need the model's tokenizer:
        without one they are refused (ValueError naming the field), never ignored."""
        if self.tokenizer is None:
            for name in ("stop", "bad_words"):
                if getattr(params, name):
                    raise ValueError(
                        f"{name}: needs the model's tokenizer, and this model has none "
                        "(use stop_token_ids / bad_words_token_ids)"
                    )
        params = self._bad_words_token_ids(params)
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.config.max_model_len - 1 if keep == -1 else keep
            token_ids = token_ids[-keep:]
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.config.model.eos_token_id,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
        )
