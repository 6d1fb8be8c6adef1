"""The `kv-offload` connector end to end: prefixes the paged pool evicted are loaded from the
host or disk tier with the tokens of a run without it, a restarted engine loads the
previous engine's files, a corrupt or truncated file is a failed load (recomputed, never
wrong tokens), and `kv_transfer_config` selects the connector as in vLLM."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tandem import LLM, SamplingParams
from tandem.core.plugin_manager import PluginConfigError
from tandem.schema.config import ConfigError
from tandem.testing.tiny_model import save_tiny_model

BLOCK = 16
BASE = ["reference-scheduler", "default-sampler"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("offload") / "llama")


def _rounds() -> list[list[list[int]]]:
    """A prompt, three unrelated prompts that push its blocks out of a 12-block pool, then
    two prompts continuing its first 64 tokens."""
    rng = random.Random(0)
    prefix = [rng.randrange(5, 200) for _ in range(64)]
    tails = [[rng.randrange(5, 200) for _ in range(8)] for _ in range(3)]
    others = [[rng.randrange(5, 200) for _ in range(60)] for _ in range(3)]
    return [[prefix + tails[0]], others, [prefix + tails[1], prefix + tails[2]]]


def _engine(model: Path, connector: dict[str, Any] | None, **kw: Any) -> LLM:
    plugins = BASE if connector is None else [*BASE, {"name": "kv-offload", "options": connector}]
    return LLM(
        model=str(model),
        num_kv_blocks=12,
        block_size=BLOCK,
        max_model_len=128,
        worker_num_threads=1,
        plugins=plugins,
        **kw,
    )


def _generate(llm: LLM) -> tuple[list[list[int]], dict[str, Any]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens: list[list[int]] = []
    try:
        for prompts in _rounds():
            inputs = [{"prompt_token_ids": p} for p in prompts]
            outs = llm.generate(inputs, params, use_tqdm=False)
            tokens += [list(o.outputs[0].token_ids) for o in outs]
        return tokens, llm.engine.stats()
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_evicted_prefixes_load_from_host_memory(tiny: Path, async_scheduling: bool) -> None:
    expected, plain = _generate(_engine(tiny, None, async_scheduling=async_scheduling))
    tokens, stats = _generate(_engine(tiny, {"cpu_blocks": 64}, async_scheduling=async_scheduling))
    assert tokens == expected
    # the continuations find the 4 prefix blocks in the store, not in the evicted pool
    assert stats["kv_connector_external_hit_tokens"] >= 4 * BLOCK
    assert stats["prefix_cache_hits"] < plain["prefix_cache_hits"] + 8 * BLOCK
    assert stats["kv_connector_failed_load_blocks"] == 0


def test_a_restarted_engine_loads_the_previous_engines_files(tiny: Path, tmp_path: Path) -> None:
    store = {"cpu_blocks": 0, "disk_path": str(tmp_path / "kv")}  # every block to disk
    expected, _ = _generate(_engine(tiny, None))
    first, first_stats = _generate(_engine(tiny, store))
    files = list((tmp_path / "kv").rglob("*.kv"))
    assert files, "the disk tier holds the saved blocks"
    second, stats = _generate(_engine(tiny, store))
    assert first == expected and second == expected
    # the restarted engine loads even the first prompt's blocks (bar its last, computed)
    assert (
        stats["kv_connector_external_hit_tokens"] > first_stats["kv_connector_external_hit_tokens"]
    )


def test_corrupt_and_truncated_files_are_recomputed(tiny: Path, tmp_path: Path) -> None:
    store = {"cpu_blocks": 0, "disk_path": str(tmp_path / "kv")}
    expected, _ = _generate(_engine(tiny, store))
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 2:
            path.write_bytes(data[: len(data) // 2])  # truncated
        else:
            data[-5] ^= 0xFF  # one payload byte flipped
            path.write_bytes(bytes(data))
    tokens, stats = _generate(_engine(tiny, store))
    assert tokens == expected
    assert stats["kv_connector_failed_load_blocks"] > 0
    assert stats["kv_connector_rolled_back_requests"] > 0


def test_kv_transfer_config_selects_the_connector(tiny: Path) -> None:
    llm = LLM(
        model=str(tiny),
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_blocks": 8},
        },
    )
    try:
        names = [name for name, _ in llm.engine.plugin_manager.stack]
        assert "kv-offload" in names
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"kv_connector": "default-sampler"}, "is not a KV connector plugin"),
        ({"kv_connector": "NoSuchConnector"}, "NoSuchConnector"),
        (
            {"kv_connector": "kv-offload", "kv_connector_extra_config": {"cpu_block": 1}},
            "cpu_block",
        ),
        ({"kv_connector": "kv-offload", "kv_role": "sender"}, "kv_role"),
    ],
)
def test_bad_kv_transfer_configs_name_the_field(
    tiny: Path, config: dict[str, Any], message: str
) -> None:
    with pytest.raises((ConfigError, PluginConfigError, ValueError), match=message):
        LLM(model=str(tiny), kv_transfer_config=config)


def test_a_stack_has_at_most_one_connector(tiny: Path) -> None:
    with pytest.raises(PluginConfigError, match="at most one kv-connector"):
        LLM(
            model=str(tiny),
            plugins=[*BASE, "kv-offload"],
            kv_transfer_config={"kv_connector": "kv-offload"},
        )


def test_the_offload_store_needs_one_worker(tiny: Path) -> None:
    """Refused by the plugin where it starts (the ranks' processes report it)."""
    with pytest.raises(Exception, match="kv-offload runs with one worker"):
        LLM(model=str(tiny), plugins=[*BASE, "kv-offload"], tensor_parallel_size=2)


def test_the_cli_flag_carries_kv_transfer_config() -> None:
    from tandem.cli import _overrides, build_parser

    flag = '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_blocks": 2}}'
    args = build_parser().parse_args(["generate", "--kv-transfer-config", flag, "hi"])
    assert _overrides(args)["kv_transfer_config"]["kv_connector"] == "OffloadingConnector"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-transfer-config", "[1]", "hi"])


def test_transfer_counters_reach_stats_metrics_and_the_trace(tiny: Path, tmp_path: Path) -> None:
    """Per-tier tokens and seconds from the worker sum into `kv_connector_transfers`, become
    `tandem:kv_connector_*{tier}` counters, and each step's phases are `kv` lane spans."""
    from tandem.plugins.tracing import StepTracer, enable_tracing
    from tandem.server.metrics import PrometheusStatLogger

    llm = _engine(tiny, {"cpu_blocks": 2, "disk_path": str(tmp_path / "kv")})
    tracer = StepTracer()
    enable_tracing(llm.engine, tracer)
    tokens, stats = _generate(llm)
    transfers = stats["kv_connector_transfers"]
    loaded = transfers.get("loaded_tokens@cpu", 0) + transfers.get("loaded_tokens@disk", 0)
    assert loaded == stats["kv_connector_external_hit_tokens"] > 0
    assert transfers["saved_tokens@cpu"] > 0 and transfers["saved_tokens@disk"] > 0
    assert transfers["load_seconds"] > 0 and transfers["save_seconds"] > 0
    kv_spans = [s for s in tracer.spans if s.lane == "kv"]
    assert {s.name for s in kv_spans} == {"kv load", "forward", "kv save"}
    assert all(s.end >= s.start for s in kv_spans)

    logger = PrometheusStatLogger("m")
    logger.record(0, stats, None)
    text = logger.render().decode()
    saved = transfers["saved_tokens@disk"]
    labels = 'engine="0",model_name="m"'
    assert f'tandem:kv_connector_saved_tokens_total{{{labels},tier="disk"}} {saved:.1f}' in text
    hits = stats["kv_connector_external_hit_tokens"]
    assert f"tandem:kv_connector_external_hit_tokens_total{{{labels}}} {hits:.1f}" in text
