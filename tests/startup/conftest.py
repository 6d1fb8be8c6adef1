"""Fixtures for the startup tests: one tiny random Llama directory per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-initialised Llama (safetensors + config.json, no tokenizer)."""
    from tandem.testing.tiny_model import save_tiny_model

    target = save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    assert (target / "config.json").exists()
    return target
