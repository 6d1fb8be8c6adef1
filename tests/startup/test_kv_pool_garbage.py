"""The KV pool is allocated without filling it (`torch.empty`), so whatever the memory held
must never reach an output: every attention path reads only slots this request wrote, or
masks the rest so that garbage cannot reach a softmax (NaN * 0 is NaN).

Each test runs one workload twice on fresh engines, once with the pool filled with zeros
and once with NaN (int garbage for the scripted model's int64 cache), and compares token for
token. The workload covers: decodes of different lengths in one batch (padded reads), a
prompt longer than the step budget (chunked prefill), a shared prefix (prefix-cache hits,
then chunked prefill after a cached prefix) and a pool too small for the batch
(preemption and recompute).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.models.cpu_kernels import paged_decode_kernel

PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # 3 full blocks of 4, + 1
PROMPTS = [PREFIX + list(range(40, 40 + k)) for k in (1, 3, 6, 9, 14, 22)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _scheduler(llm: LLM) -> Any:
    return llm.engine.plugin_manager.get_plugin("reference-scheduler")


def _fill_pool(llm: LLM, value: float) -> None:
    model = llm.engine.executor.worker.model
    if hasattr(model, "kv_caches"):
        for key, val in model.kv_caches:
            key.fill_(value)
            val.fill_(value)
    else:  # the scripted model: one int64 per slot
        gen = torch.Generator().manual_seed(int(value) if value == value else 7)
        model.kv_cache.copy_(torch.randint(-(2**40), 2**40, model.kv_cache.shape, generator=gen))


def _run(model: str, fill: float, **overrides: Any) -> list[list[int]]:
    llm = LLM(
        model=model,
        block_size=4,
        num_kv_blocks=24,
        max_model_len=64,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        async_scheduling=False,
        dtype="float32",
        **overrides,
    )
    try:
        model = llm.engine.executor.worker.model
        if overrides.get("attention") == "auto" and paged_decode_kernel() is not None:
            assert model.decode_kernel is not None, "the compiled decode kernel must run"
        if overrides.get("attention") == "torch":
            assert model.decode_kernel is None
        _fill_pool(llm, fill)
        first = llm.generate(PROMPTS, PARAMS)
        hits_before = _scheduler(llm).kv_cache_manager.prefix_cache_hits
        again = llm.generate(PROMPTS[::-1], PARAMS)  # prefix-cache hits on finished blocks
        scheduler = _scheduler(llm)
        assert scheduler.num_preemptions > 0, "the workload must preempt"
        assert scheduler.kv_cache_manager.prefix_cache_hits > hits_before, "must hit the cache"
        outs = [o.outputs[0].token_ids for o in first] + [o.outputs[0].token_ids for o in again]
        assert all(len(ids) == PARAMS.max_tokens for ids in outs)
        return outs
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_nan_filled_pool_gives_the_outputs_of_a_zero_filled_one(
    tiny_llama_dir: Path, attention: str
) -> None:
    """`auto`: the compiled CPU decode kernel (when a compiler is present) and SDPA prefill;
    `torch`: SDPA decode groups over padded gathers, and SDPA prefill."""
    zero = _run(str(tiny_llama_dir), 0.0, attention=attention)
    nan = _run(str(tiny_llama_dir), float("nan"), attention=attention)
    assert nan == zero


def test_garbage_filled_scripted_pool_gives_the_same_outputs() -> None:
    clean = _run("scripted", -1, vocab_size=128)
    garbage = _run("scripted", 3, vocab_size=128)
    assert garbage == clean


def test_pool_is_allocated_without_filling(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Zero-filling a 4 GiB pool costs seconds at every start; it must not happen."""
    calls: list[tuple[Any, ...]] = []
    real_zeros = torch.zeros

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args)
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", spy)
    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=4096, max_model_len=64)
    try:
        pool_shapes = {
            tuple(t.shape) for pair in llm.engine.executor.worker.model.kv_caches for t in pair
        }
        filled = [
            a for a in calls if a and tuple(a[0] if isinstance(a[0], tuple) else a) in pool_shapes
        ]
        assert not filled, f"the KV pool was zero-filled: {filled[:2]}"
    finally:
        llm.engine.shutdown()
