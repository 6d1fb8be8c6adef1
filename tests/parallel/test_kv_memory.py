"""Each rank measures what its memory holds for KV; the engine takes the minimum over the
ranks and shrinks every pool to it before the scheduler is built (`core/worker/kv_memory`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.worker import kv_memory
from tandem.schema.config import ConfigError, EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 50))]


class _Ranks:
    """An executor whose ranks report fixed capacities and record resizes."""

    def __init__(self, fits: list[int | None]) -> None:
        self.fits = fits
        self.resized: list[int] = []

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if method == "kv_cache_capacity":
            return [{"blocks": 100, "fits": f} for f in self.fits]
        assert method == "resize_kv_cache"
        self.resized.append(args[0])
        return [None] * len(self.fits)


def _config(blocks: int = 100, max_model_len: int = 64) -> EngineConfig:
    config = EngineConfig()
    config.cache.num_kv_blocks = blocks
    config.cache.block_size = 4
    config.model.max_model_len = max_model_len
    return config


def test_the_engine_takes_the_smallest_rank() -> None:
    config, ranks = _config(), _Ranks([80, 60, None, 90])
    kv_memory.fit_kv_cache(config, ranks)
    assert ranks.resized == [60] and config.cache.num_kv_blocks == 60


def test_a_pool_that_fits_everywhere_is_kept() -> None:
    config, ranks = _config(), _Ranks([100, 250])
    kv_memory.fit_kv_cache(config, ranks)
    assert ranks.resized == [] and config.cache.num_kv_blocks == 100
    unmeasured = _Ranks([None, None])
    kv_memory.fit_kv_cache(config, unmeasured)
    assert unmeasured.resized == []


def test_a_pool_too_small_for_one_request_is_refused_naming_the_keys() -> None:
    config, ranks = _config(max_model_len=64), _Ranks([80, 15])  # 15 x 4 = 60 < 64
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_memory_gib: rank 1.*15 KV blocks"):
        kv_memory.fit_kv_cache(config, ranks)
    assert ranks.resized == [] and config.cache.num_kv_blocks == 100


def test_an_executor_without_collective_rpc_keeps_the_plan() -> None:
    class NoRpc:
        def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
            raise NotImplementedError

    config = _config()
    kv_memory.fit_kv_cache(config, NoRpc())
    assert config.cache.num_kv_blocks == 100


def test_meminfo_and_cpu_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2048 kB\nMemAvailable:   1000 kB\n")
    assert kv_memory.mem_available_bytes(meminfo) == 1000 * 1024
    assert kv_memory.mem_available_bytes(tmp_path / "missing") is None
    monkeypatch.setattr(kv_memory, "mem_available_bytes", lambda: 1 << 20)
    cpu = torch.device("cpu")
    one_rank = kv_memory.fitting_blocks(cpu, 1024, 0, 1, 0.9)
    assert one_rank == int((1 << 20) * kv_memory.CPU_MEMORY_FRACTION) // 1024
    assert kv_memory.fitting_blocks(cpu, 1024, 0, 4, 0.9) == one_rank * 1024 // 4 // 1024


def test_a_short_host_shrinks_the_pool_and_outputs_stay_exact(
    tiny_dirs: dict[str, Path], closing: list[LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-process worker measures (patched: a host with room for 40 blocks of the
    planned 200); the pool, the scheduler's KV manager and the config hold 40, and the
    tokens equal an engine built with 40 blocks."""
    # tiny Llama, float32: 2 layers x (K + V) x 2 KV heads x 16 dims x 4 bytes x block 4.
    block_bytes = 2 * 2 * 2 * 16 * 4 * 4
    room = int(40 * block_bytes / kv_memory.CPU_MEMORY_FRACTION) + 1
    monkeypatch.setattr(kv_memory, "mem_available_bytes", lambda: room)
    kw = dict(model=str(tiny_dirs["llama"]), dtype="float32", block_size=4, max_model_len=64)
    short = LLM(num_kv_blocks=200, executor="inprocess", **kw)
    closing.append(short)
    assert short.engine.config.cache.num_kv_blocks == 40
    (report,) = short.engine.executor.collective_rpc("kv_cache_capacity")
    assert report == {"blocks": 40, "fits": 40}
    scheduler = short.engine.plugin_manager.plugins_with_role("scheduler")[0]
    assert scheduler.kv_cache_manager.block_pool.num_blocks == 40
    monkeypatch.undo()
    exact = LLM(num_kv_blocks=40, executor="inprocess", **kw)
    closing.append(exact)
    tokens = [list(o.outputs[0].token_ids) for o in short.generate(PROMPTS, GREEDY)]
    assert tokens == [list(o.outputs[0].token_ids) for o in exact.generate(PROMPTS, GREEDY)]


def test_every_rank_reports_its_capacity(tiny_dirs: dict[str, Path], closing: list[LLM]) -> None:
    """Two ranks on one host each measure their share of the host's memory."""
    llm = LLM(model=str(tiny_dirs["llama"]), tensor_parallel_size=2, num_kv_blocks=64)
    closing.append(llm)
    reports = llm.engine.executor.collective_rpc("kv_cache_capacity")
    assert [r["blocks"] for r in reports] == [64, 64]
    assert all(r["fits"] is not None and r["fits"] > 0 for r in reports)
