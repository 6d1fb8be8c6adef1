"""The sampling parameters `LLM` uses when given none: the model's generation config.

`model.generation_config`: `"auto"` reads the model's `generation_config.json` (temperature,
top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) over
`SamplingParams()`'s own; `"vllm"` ignores it; a directory path reads that directory's file.
A model without tokenizer has no generation defaults. Values `SamplingParams` refuses are a
`ConfigError` naming the file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tandem.schema.config import ConfigError, EngineConfig
from tandem.schema.sampling_params import SamplingParams

#: Logged under the front door's name: these are `LLM`'s defaults.
logger = logging.getLogger("tandem.llm")


def load_generation_defaults(config: EngineConfig, has_tokenizer: bool) -> dict[str, Any]:
    """The `SamplingParams` fields `LLM.get_default_sampling_params` sets (empty for
    `"vllm"` and for a model without tokenizer); validated, logged when not empty."""
    from tandem.models.model_files import generation_defaults

    choice = config.model.generation_config
    if choice == "vllm" or (choice == "auto" and not has_tokenizer):
        return {}
    directory = Path(config.model.model if choice == "auto" else choice).expanduser()
    if choice != "auto" and not (directory / "generation_config.json").exists():
        raise ConfigError(
            f"model.generation_config: {choice!r} is not 'auto', 'vllm' or a directory "
            "holding a generation_config.json"
        )
    defaults = generation_defaults(directory)
    try:
        SamplingParams(**defaults)
    except ValueError as exc:  # SamplingParamsError: one line per bad field
        where = f"model.generation_config: {directory / 'generation_config.json'}:"
        raise ConfigError(str(exc).replace("SamplingParams:", where)) from None
    if defaults:
        logger.info(
            "default sampling parameters from %s: %s (used when no SamplingParams is "
            "given; generation_config='vllm' turns them off)",
            directory / "generation_config.json",
            defaults,
        )
    return defaults
