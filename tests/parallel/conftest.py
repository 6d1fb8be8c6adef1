"""Tiny random models for the multi-rank tests (saved once per session, no tokenizer), and
`closing`: engines shut down after the test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem import LLM
from tandem.testing.tiny_model import TINY_ARCHS, save_tiny_model, save_tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-models")
    return {arch: save_tiny_model(arch, root / arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a word-level tokenizer (grammars need one)."""
    directory = tmp_path_factory.mktemp("tp-chat") / "llama"
    save_tiny_model("llama", directory)
    save_tiny_tokenizer(directory)
    return directory


@pytest.fixture
def closing() -> Iterator[list[LLM]]:
    """Engines to shut down after the test (their rank processes with them)."""
    engines: list[LLM] = []
    yield engines
    for llm in engines:
        llm.engine.shutdown()
