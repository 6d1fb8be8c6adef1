"""Fixtures for the front door (`LLM`, the CLI): a Hugging Face hub-layout cache built
offline in a temp directory.

`hub_cache` points `HF_HUB_CACHE` (and `huggingface_hub.constants.HF_HUB_CACHE`, read at
import time) at a cache holding `models--tiny-org--tiny-llama/snapshots/<hash>/`: the tiny
random Llama of `tandem.testing.tiny_model`, a word-level tokenizer over its 384 ids with a
chat template, and no sampling defaults in its `generation_config.json`. Nothing touches
the network: the suite runs with `HF_HUB_OFFLINE=1`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from frontdoor_helpers import HUB_ID, save_tiny_tokenizer, write_hub_snapshot

from tandem.testing.tiny_model import save_tiny_model


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a tokenizer and a chat template (a plain directory)."""
    directory = tmp_path_factory.mktemp("tiny-chat-llama")
    save_tiny_model("llama", directory)
    save_tiny_tokenizer(directory)
    config = json.loads((directory / "generation_config.json").read_text())
    assert "temperature" not in config and "max_new_tokens" not in config
    return directory


@pytest.fixture
def hub_cache(
    tmp_path: Path, tiny_chat_model: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path]:
    """(cache root, snapshot of `HUB_ID`) with the hub cache pointed at the temp root."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = write_hub_snapshot(cache, HUB_ID, tiny_chat_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache, snapshot
