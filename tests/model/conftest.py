"""Shared fixtures for the real-model tests: tiny random HF models and the embedded SmolLM2.

Tiny models (Llama, Qwen2, Qwen3) are built from configs with a large init scale so the
top-2 logits are well apart, then saved with `save_pretrained` (no tokenizer files: their
prompts are token ids). `hf_greedy` is the reference: transformers' own `generate()`, and it
asserts the top-1/top-2 logit gap at every step so a parity check cannot flip on fp noise.

Everything runs on the CPU with one torch thread and without the network.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.testing.tiny_model import TINY_ARCHS, save_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

#: The smallest top-1 minus top-2 logit gap the reference may show at any greedy step.
MIN_LOGIT_GAP = 1e-3


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def two_threads():  # noqa: ANN201
    """Two torch threads for one test (kernels that split work between threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> directory of a tiny random-initialised causal LM (safetensors, no tokenizer)."""
    root = tmp_path_factory.mktemp("tiny-models")
    dirs = {}
    for arch in TINY_ARCHS:
        target = save_tiny_model(arch, root / arch)
        assert (target / "config.json").exists()
        assert not (target / "tokenizer.json").exists()
        dirs[arch] = target
    return dirs


class HFReference:
    """transformers `generate()` on a model directory, cached per (dir, prompt, n)."""

    def __init__(self) -> None:
        self._models: dict[str, Any] = {}
        self._results: dict[tuple[str, tuple[int, ...], int], tuple[list[int], float]] = {}

    def model(self, model_dir: Path | str) -> Any:
        key = str(model_dir)
        if key not in self._models:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
            # Never stop early: tandem runs these with ignore_eos=True.
            model.generation_config.eos_token_id = None
            self._models[key] = model
        return self._models[key]

    def greedy_with_gap(
        self, model_dir: Path | str, prompt_ids: list[int], max_new_tokens: int
    ) -> tuple[list[int], float]:
        """(new tokens, min over steps of top1 - top2 logit)."""
        key = (str(model_dir), tuple(int(t) for t in prompt_ids), max_new_tokens)
        if key not in self._results:
            model = self.model(model_dir)
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([list(key[1])], dtype=torch.int64),
                    attention_mask=torch.ones((1, len(key[1])), dtype=torch.int64),
                    max_new_tokens=max_new_tokens,
                    min_new_tokens=None,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            new = out.sequences[0, len(key[1]) :].tolist()
            assert len(new) == max_new_tokens, f"HF stopped early: {len(new)} < {max_new_tokens}"
            gaps = [float(lg[0].float().topk(2).values.diff().neg()) for lg in out.logits]
            for step, lg in enumerate(out.logits):  # greedy must be the argmax of the logits
                assert int(lg[0].argmax()) == new[step]
            self._results[key] = (new, min(gaps))
        return self._results[key]


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    return HFReference()


@pytest.fixture(scope="session")
def hf_greedy(hf_reference: HFReference) -> Callable[..., list[int]]:
    """`hf_greedy(model_dir, prompt_ids, max_new_tokens)`: HF greedy new tokens, asserting
    that the top-2 logits are at least MIN_LOGIT_GAP apart at every step."""

    def run(
        model_dir: Path | str,
        prompt_ids: list[int],
        max_new_tokens: int,
        min_gap: float = MIN_LOGIT_GAP,
    ) -> list[int]:
        tokens, gap = hf_reference.greedy_with_gap(model_dir, prompt_ids, max_new_tokens)
        assert gap >= min_gap, (
            f"reference top-2 logit gap {gap:.3g} < {min_gap} for prompt {list(prompt_ids)[:8]}..."
            f" (len {len(prompt_ids)}) on {model_dir}: parity would be fragile; change the"
            f" model seed or the prompt"
        )
        return tokens

    return run


# The embedded SmolLM2 ------------------------------------------------------------------
SMOL_KV_BLOCKS = 96
SMOL_BLOCK_SIZE = 16
SMOL_MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted HF directory of the embedded SmolLM2 (converted once into the cache)."""
    from tandem.models.model_files import resolve_model_dir

    return resolve_model_dir("default")


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_dir: Path) -> Any:
    """One `LLM(model="default")` for the whole session, with a small KV pool."""
    from tandem.llm import LLM

    llm = LLM(
        model="default",
        num_kv_blocks=SMOL_KV_BLOCKS,
        block_size=SMOL_BLOCK_SIZE,
        max_model_len=SMOL_MAX_MODEL_LEN,
        dtype="float32",
    )
    assert Path(llm.config.model.model) == smollm2_dir
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path) -> Any:
    from tandem.models.model_files import load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    assert tokenizer is not None, f"{smollm2_dir} has no tokenizer files"
    return tokenizer
