"""The loader of the scripted test model (`model: scripted`): no files, no tokenizer.

Declared under the entry-point group `tandem.model_loaders` with the kind `scripted`; the
kernel knows the model only through what this class declares.
"""

from __future__ import annotations

from typing import ClassVar

from tandem.schema.config import EngineConfig
from tandem.testing.scripted_model import ScriptedModel

SCRIPTED_DEFAULT_VOCAB = 128
SCRIPTED_DEFAULT_EOS = 1
SCRIPTED_DEFAULT_MAX_MODEL_LEN = 1024


class ScriptedModelLoader:
    """Token ids in, deterministic tokens out (`scripted_model`), through the paged cache."""

    model_kinds: ClassVar[tuple[str, ...]] = ("scripted",)
    has_tokenizer: ClassVar[bool] = False
    simulatable: ClassVar[bool] = True

    @classmethod
    def resolve_limits(cls, config: EngineConfig) -> None:
        """Vocabulary 128, EOS 1 and max_model_len 1024 unless the config sets them."""
        model = config.model
        if model.vocab_size is None:
            model.vocab_size = SCRIPTED_DEFAULT_VOCAB
        if model.eos_token_id is None:
            model.eos_token_id = SCRIPTED_DEFAULT_EOS
        if model.max_model_len is None:
            model.max_model_len = SCRIPTED_DEFAULT_MAX_MODEL_LEN

    @classmethod
    def load(cls, config: EngineConfig) -> ScriptedModel:
        assert config.model.vocab_size is not None and config.cache.num_kv_blocks is not None
        return ScriptedModel(
            vocab_size=config.model.vocab_size,
            num_blocks=config.cache.num_kv_blocks,
            block_size=config.cache.block_size,
        )
