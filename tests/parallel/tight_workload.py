"""The multi-rank tests' shared engine settings: a KV pool small enough to preempt (18
blocks of 4 = 72 tokens for the ~150 the prompts need), a 16-token budget that chunks the
long prompt, prefix caching on; and greedy sampling of 16 tokens, EOS ignored."""

from __future__ import annotations

from tandem import SamplingParams

TIGHT = dict(
    block_size=4,
    num_kv_blocks=18,
    max_model_len=64,
    max_num_batched_tokens=16,
    enable_prefix_caching=True,
)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
