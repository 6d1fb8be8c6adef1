"""Builders for the front-door tests: a tokenizer for the tiny random Llama and the
Hugging Face hub cache layout, both made offline."""

from __future__ import annotations

import shutil
from pathlib import Path

from tandem.testing.tiny_model import CHAT_TEMPLATE, WORDS, save_tiny_tokenizer

__all__ = ["CHAT_TEMPLATE", "HUB_ID", "WORDS", "save_tiny_tokenizer", "write_hub_snapshot"]

HUB_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_snapshot(cache: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """Lay `source`'s files out as the hub cache does: `models--org--name/refs/main` names
    the commit, `snapshots/<commit>/` holds the files. Returns the snapshot directory."""
    org, name = repo_id.split("/")
    storage = cache / f"models--{org}--{name}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        shutil.copy2(path, snapshot / path.name)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot
