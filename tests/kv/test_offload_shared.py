"""The shared store (`kv-offload` with `shared: true`): engines on one host pointed at one
directory find each other's prefixes, with the tokens of an engine that computed them;
`tandem serve`'s data-parallel engines (AsyncLLM, `data_parallel_size=2`) are the case it
is for."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.async_llm import AsyncLLM
from tandem.schema.config import ConfigError
from tandem.testing.tiny_model import save_tiny_model

BLOCK = 16
BASE = ["reference-scheduler", "default-sampler"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("shared") / "llama")


def _prefix_and_tails() -> tuple[list[int], list[list[int]]]:
    rng = random.Random(5)
    prefix = [rng.randrange(5, 200) for _ in range(70)]
    return prefix, [[rng.randrange(5, 200) for _ in range(6)] for _ in range(2)]


def _store(path: Path, **extra: Any) -> dict[str, Any]:
    return {"name": "kv-offload", "options": {"disk_path": str(path), "shared": True, **extra}}


def _llm(model: Path, plugins: list[Any]) -> LLM:
    return LLM(
        model=str(model), block_size=BLOCK, max_model_len=256, worker_num_threads=1, plugins=plugins
    )


def _tokens(llm: LLM, prompt: list[int]) -> list[int]:
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_a_second_engine_loads_the_first_engines_blocks(tiny: Path, tmp_path: Path) -> None:
    prefix, (tail_a, tail_b) = _prefix_and_tails()
    plain = _llm(tiny, BASE)
    expected = [_tokens(plain, prefix + tail_a), _tokens(plain, prefix + tail_b)]
    plain.engine.shutdown()
    # both engines live at once, as data-parallel engines do; a big host tier: the blocks
    # still reach the directory at once (written through)
    first = _llm(tiny, [*BASE, _store(tmp_path, cpu_blocks=1000)])
    second = _llm(tiny, [*BASE, _store(tmp_path, cpu_blocks=1000)])
    try:
        assert _tokens(first, prefix + tail_a) == expected[0]
        assert list(tmp_path.rglob("*.kv")), "the blocks are in the shared directory"
        assert _tokens(second, prefix + tail_b) == expected[1]
        stats = second.engine.stats()
        assert stats["kv_connector_external_hit_tokens"] == len(prefix) // BLOCK * BLOCK
        assert stats["kv_connector_transfers"]["loaded_tokens@disk"] > 0
    finally:
        first.engine.shutdown()
        second.engine.shutdown()


def test_data_parallel_engines_share_prefixes(tiny: Path, tmp_path: Path) -> None:
    """Engine 0 computes a prefix; while it is busy with another request the front end
    sends the next request with that prefix to engine 1, which loads it from the store."""
    prefix, (tail_a, tail_b) = _prefix_and_tails()
    plain = _llm(tiny, BASE)
    expected = _tokens(plain, prefix + tail_b)
    plain.engine.shutdown()
    eng = AsyncLLM(
        model=str(tiny),
        block_size=BLOCK,
        max_model_len=256,
        worker_num_threads=1,
        data_parallel_size=2,
        plugins=[*BASE, _store(tmp_path)],
    )
    long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)

    async def main() -> list[int]:
        async def run(prompt: list[int], params: SamplingParams, rid: str) -> list[int]:
            outs = [o async for o in eng.generate(prompt, params, rid)]
            return list(outs[-1].outputs[0].token_ids)

        await run(prefix + tail_a, GREEDY, "a")  # engine 0 (both idle)
        busy = asyncio.ensure_future(run([3, 4, 5, 6], long, "busy"))  # engine 0 again
        await asyncio.sleep(0)
        tokens = await run(prefix + tail_b, GREEDY, "b")  # engine 1: engine 0 is busy
        await busy
        return tokens

    try:
        assert asyncio.run(main()) == expected
        hits = [s.get("kv_connector_external_hit_tokens", 0) for s in eng.engine_stats()]
        assert hits[1] == len(prefix) // BLOCK * BLOCK, hits
    finally:
        eng.shutdown()


def test_a_shared_store_needs_a_directory(tiny: Path) -> None:
    with pytest.raises(Exception, match="shared store needs disk_path"):
        _llm(tiny, [*BASE, {"name": "kv-offload", "options": {"shared": True}}])
    assert issubclass(ConfigError, Exception)
