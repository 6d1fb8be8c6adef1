"""Fixtures for the structured-output tests: the embedded SmolLM2's tokenizer, both grammar
backends over it, and a grammar plugin built on a config pointing at the model files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tandem.schema.config import EngineConfig, ModelConfig


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from tandem.models.model_files import resolve_model_dir

    return resolve_model_dir("default")


@pytest.fixture(scope="session")
def smollm2_config(smollm2_dir: Path) -> EngineConfig:
    """A config whose model fields are resolved as `resolve_config` would (vocab, EOS)."""
    from tandem.models.model_files import load_hf_config

    hf = load_hf_config(smollm2_dir)
    return EngineConfig(
        model=ModelConfig(
            model=str(smollm2_dir),
            vocab_size=hf.vocab_size,
            eos_token_id=hf.eos_token_id,
            max_model_len=1024,
        )
    )


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir: Path) -> Any:
    from tandem.models.model_files import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def backends(tokenizer: Any, smollm2_config: EngineConfig) -> dict[str, Any]:
    """name -> backend, both over the SmolLM2 tokenizer."""
    from tandem.structured_output.outlines_backend import OutlinesBackend
    from tandem.structured_output.xgrammar_backend import XgrammarBackend

    model = smollm2_config.model
    assert model.vocab_size is not None
    return {
        "xgrammar": XgrammarBackend(tokenizer, model.vocab_size, model.eos_token_id),
        "outlines": OutlinesBackend(tokenizer, model.vocab_size, model.eos_token_id),
    }
