"""The test kit's tiny-model fixture runs through tandem and matches transformers."""

from __future__ import annotations

from tandem.llm import LLM
from tandem.schema.sampling_params import SamplingParams
from tandem.testing.tiny_model import TINY_VOCAB


def test_tiny_model_dir_fixture_generates_like_transformers(tiny_model_dir, hf_greedy) -> None:
    model_dir = tiny_model_dir("qwen2")
    assert tiny_model_dir("qwen2") == model_dir  # built once per session
    prompt = [5, 17, 99, 3, 250]
    llm = LLM(model=str(model_dir), max_model_len=64, num_kv_blocks=16, block_size=8)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    llm.shutdown()
    tokens = out[0].outputs[0].token_ids
    assert all(0 <= t < TINY_VOCAB for t in tokens)
    assert tokens == hf_greedy(model_dir, prompt, 8)
