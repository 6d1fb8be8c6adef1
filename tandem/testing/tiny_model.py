"""Tiny random-initialised HF causal LMs for tests: built from configs, never downloaded.

`save_tiny_model(arch, directory)` writes a 2-layer Llama / Qwen2 / Qwen3 model (vocab 384,
GQA 4 query / 2 KV heads of 16, untied embeddings, no tokenizer: prompts are token ids)
with a large init scale, so the top-2 logits are far apart and greedy parity against
`transformers` cannot flip on float noise. The seed per architecture is fixed, so the
weights are the same on every machine. `LLM(model=str(directory))` loads it.
`save_tiny_tokenizer(directory)` adds a word-level tokenizer over the same 384 ids with a
chat template, for tests of text prompts, stop strings and chat (no download either).
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VOCAB = 384
TINY_EOS = 2
TINY_ARCHS = ("llama", "qwen2", "qwen3")
#: Seeds for which the parity workloads keep a top-2 logit gap >= 0.02 (checked by tests).
TINY_SEEDS = {"llama": 9, "qwen2": 22, "qwen3": 29}
INIT_RANGE = 1.0


def tiny_config(arch: str):  # noqa: ANN201 - a transformers PretrainedConfig
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if arch not in classes:
        raise ValueError(f"arch: expected one of {sorted(classes)}, got {arch!r}")
    return classes[arch](
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        bos_token_id=1,
        eos_token_id=TINY_EOS,
        pad_token_id=0,
    )


def save_tiny_model(arch: str, directory: Path) -> Path:
    """Write the tiny `arch` model (safetensors + config.json) to `directory`; return it."""
    from transformers import AutoModelForCausalLM

    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(TINY_SEEDS[arch])
        model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(directory)
    return directory


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
