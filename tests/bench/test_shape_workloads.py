"""The workload shapes of issue 16 (benchmarks/make_shape_workloads.py) and how their
"engine" sections reach the engines. No engine runs here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tandem import bench

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "benchmarks" / "workloads"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def maker() -> ModuleType:
    return _load("make_shape_workloads", ROOT / "benchmarks" / "make_shape_workloads.py")


@pytest.fixture(scope="module")
def shapes(maker: ModuleType) -> dict[str, dict[str, Any]]:
    return maker.build_all()


def _lens(workload: dict[str, Any]) -> list[int]:
    return [len(r["prompt_token_ids"]) for r in workload["requests"]]


def test_generator_is_deterministic_and_matches_the_checkout_files(
    maker: ModuleType, shapes: dict[str, dict[str, Any]]
) -> None:
    assert maker.build_all() == shapes
    for name, workload in shapes.items():
        assert json.loads((WORKLOADS / f"{name}.json").read_text()) == workload


def test_every_shape_has_its_request_count_lengths_and_outputs(
    shapes: dict[str, dict[str, Any]],
) -> None:
    expected = {  # name: (requests, min prompt, max prompt, max_tokens)
        "summarise": (24, 1024, 2048, 32),
        "generate_long": (16, 32, 32, 512),
        "burst256": (256, 16, 256, 64),
        "shared_prefix_chat": (128, 1024 + 16, 1024 + 8 * 48 + 7 * 32, 64),
    }
    for name, (count, lo, hi, out) in expected.items():
        workload = shapes[name]
        assert len(workload["requests"]) == count
        assert lo <= min(_lens(workload)) and max(_lens(workload)) <= hi
        assert {r["max_tokens"] for r in workload["requests"]} == {out}
        ids = {t for r in workload["requests"] for t in r["prompt_token_ids"]}
        assert min(ids) >= 100 and max(ids) < 49_000


def test_chat_turns_share_the_system_prompt_and_extend_the_previous_turn(
    shapes: dict[str, dict[str, Any]],
) -> None:
    reqs = shapes["shared_prefix_chat"]["requests"]
    system = reqs[0]["prompt_token_ids"][:1024]
    assert all(r["prompt_token_ids"][:1024] == system for r in reqs)
    assert [r["turn"] for r in reqs] == [t for t in range(8) for _ in range(16)]
    by_conv: dict[int, list[list[int]]] = {}
    for r in reqs:
        by_conv.setdefault(r["conversation"], []).append(r["prompt_token_ids"])
    assert len(by_conv) == 16
    for prompts in by_conv.values():
        for prev, cur in zip(prompts, prompts[1:], strict=False):
            new = len(cur) - len(prev)
            assert cur[: len(prev)] == prev and 32 + 16 <= new <= 32 + 48
    # the conversations differ after the system prompt
    assert len({tuple(p[0][1024:]) for p in by_conv.values()}) == 16


def test_engine_sections_size_the_engines_to_the_workload(
    shapes: dict[str, dict[str, Any]],
) -> None:
    for workload in shapes.values():
        engine = workload["engine"]
        longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in workload["requests"])
        assert engine["max_model_len"] % 256 == 0
        assert longest <= engine["max_model_len"] < longest + 256
        assert isinstance(engine["kv_cache_memory_gib"], int) and engine["kv_cache_memory_gib"] >= 1
        assert engine["enable_prefix_caching"] is (workload["name"] == "shared_prefix_chat")
    assert shapes["burst256"]["engine"]["max_num_seqs"] == 256


@pytest.mark.parametrize("name", ["default", "latency"])
def test_default_and_latency_files_carry_the_builtin_engine_section(name: str) -> None:
    checkout = json.loads((WORKLOADS / f"{name}.json").read_text())
    assert checkout["engine"] == bench.BUILTIN_ENGINES[name]
    assert bench.load_workload(name) == checkout


def test_engine_kwargs_maps_the_engine_section_to_llm_keywords() -> None:
    workload = {
        "requests": [],
        "engine": {
            "max_num_seqs": 16,
            "max_model_len": 1792,
            "enable_prefix_caching": True,
            "max_num_batched_tokens": 2048,
            "kv_cache_memory_gib": 2,
            "something_else": 1,
        },
    }
    assert bench.engine_kwargs(workload) == {
        "max_num_seqs": 16,
        "max_model_len": 1792,
        "enable_prefix_caching": True,
        "max_num_batched_tokens": 2048,
        "kv_cache_memory_gib": 2,
    }
    assert bench.engine_kwargs({"requests": []}) == {}


def test_tandem_config_takes_the_engine_section() -> None:
    from tandem.stack_file import load_config

    engine = json.loads((WORKLOADS / "shared_prefix_chat.json").read_text())["engine"]
    config = load_config(None, model="scripted", **bench.engine_kwargs({"engine": engine}))
    assert config.scheduler.max_num_seqs == 16
    assert config.scheduler.max_num_batched_tokens == 2048
    assert config.model.max_model_len == 1792
    assert config.cache.enable_prefix_caching is True
    assert config.cache.kv_cache_memory_gib == 2


def test_roofline_ceiling_counts_a_shared_prefix_once() -> None:
    roofline = _load("machine_roofline", ROOT / "benchmarks" / "machine_roofline.py")
    reqs = [
        {"prompt_token_ids": [1, 2, 3, 4], "max_tokens": 2},
        {"prompt_token_ids": [1, 2, 3, 5], "max_tokens": 2},
    ]
    assert roofline.computed_prompt_tokens({"requests": reqs}) == 8
    cached = {"requests": reqs, "engine": {"enable_prefix_caching": True}}
    assert roofline.computed_prompt_tokens(cached) == 5
    params = {"embedding": 10, "body": 100, "lm_head": 10}
    # 8 prompt + 4 output - 2 last = 10 forward tokens x 200 FLOPs + 4 x 20 for logits
    assert roofline.throughput_ceiling({"requests": reqs}, params, 1e-9) == pytest.approx(4 / 2080)
