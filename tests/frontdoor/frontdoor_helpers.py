"""Builders for the front-door tests: a tokenizer for the tiny random Llama and the
Hugging Face hub cache layout, both made offline."""

from __future__ import annotations

import shutil
from pathlib import Path

from tandem.testing.tiny_model import TINY_EOS, TINY_VOCAB

HUB_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
#: A chat template for the word-level tokenizer (every token is one whitespace-split word).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
WORDS = ["hello", "world", "the", "capital", "of", "France", "is", "Paris", "a", "cat"]


def save_tiny_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer over exactly `TINY_VOCAB` ids (`<s>` = 1, `</s>` = the tiny
    model's EOS), built offline with `tokenizers`, with `CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    words = specials + WORDS
    words += [f"w{i}" for i in range(TINY_VOCAB - len(words))]
    assert len(words) == TINY_VOCAB and words[TINY_EOS] == "</s>"
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


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
