"""Choosing the `StepModel` a config asks for."""

from __future__ import annotations

from tandem.core.config import ConfigError, EngineConfig
from tandem.core.worker.model_runner import StepModel
from tandem.core.worker.scripted_model import ScriptedModel

SCRIPTED = "scripted"


def load_step_model(config: EngineConfig) -> StepModel:
    """Build the model for `config.model.model` with a paged cache of `cache.num_kv_blocks`."""
    num_blocks = config.cache.num_kv_blocks
    if num_blocks is None:
        raise ConfigError("cache.num_kv_blocks must be resolved before the model is loaded")
    if config.model.model == SCRIPTED:
        assert config.model.vocab_size is not None
        return ScriptedModel(
            vocab_size=config.model.vocab_size,
            num_blocks=num_blocks,
            block_size=config.cache.block_size,
        )
    raise ConfigError(
        f"model.model: {config.model.model!r}: only the scripted model is available in this build"
    )
