"""Prefill/decode disaggregation with `kv-disagg`: a producer engine computes prompts and
serves their blocks over ZeroMQ; a consumer engine loads them asynchronously
(WAITING_FOR_REMOTE_KVS) and decodes. Greedy outputs equal a single engine's; a block the
producer cannot supply is a failed load that is recomputed; an unreachable producer means
local prefill; a request waiting for its blocks never holds up the others."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.request import RequestStatus
from tandem.plugins.kv_disagg.transport import BlockClient, BlockServer, TransportError
from tandem.schema.config import ConfigError
from tandem.testing.engine import make_request
from tandem.testing.tiny_model import save_tiny_model

BLOCK = 16
BASE = ["reference-scheduler", "default-sampler"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("disagg") / "llama")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(rng.randrange(20, 90))] for _ in range(n)]


def _engine(model: Path, connector: dict[str, Any] | None, **kw: Any) -> LLM:
    plugins = [*BASE, {"name": "kv-disagg", "options": connector}] if connector else BASE
    kw.setdefault("executor", "thread")
    return LLM(
        model=str(model),
        num_kv_blocks=40,
        block_size=BLOCK,
        max_model_len=256,
        worker_num_threads=1,
        plugins=plugins,
        **kw,
    )


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    inputs = [{"prompt_token_ids": p} for p in prompts]
    return [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False)]


def _single_engine(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = _engine(model, None)
    try:
        return _generate(llm, prompts, GREEDY)
    finally:
        llm.engine.shutdown()


def _worker_connector(llm: LLM) -> Any:
    worker = llm.engine.executor.worker  # the thread executor's in-process worker
    return worker.plugin_manager.plugins_with_role("kv-connector")[0]


@pytest.mark.parametrize(
    ("async_scheduling", "executor"), [(False, "thread"), (True, "thread"), (False, "mp")]
)
def test_the_pair_decodes_what_one_engine_does(
    tiny: Path, async_scheduling: bool, executor: str
) -> None:
    prompts = _prompts()
    expected = _single_engine(tiny, prompts)
    port = _free_port()
    producer = _engine(tiny, {"kv_role": "kv_producer", "port": port})
    consumer = _engine(
        tiny,
        {"kv_role": "kv_consumer", "peer": f"127.0.0.1:{port}"},
        async_scheduling=async_scheduling,
        executor=executor,
    )
    try:
        _generate(producer, prompts, PREFILL)
        assert _generate(consumer, prompts, GREEDY) == expected
        stats = consumer.engine.stats()
        # every prompt's whole blocks but the one holding its last token came over the wire
        loadable = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)
        assert stats["kv_connector_external_hit_tokens"] == loadable
        assert stats["kv_connector_transfers"]["loaded_tokens@remote"] == loadable
        assert stats["kv_connector_failed_load_blocks"] == 0
        assert consumer.engine.plugin_manager.plugins_with_role("scheduler")[
            0
        ].kv_cache_manager.all_blocks_free()
    finally:
        consumer.engine.shutdown()
        producer.engine.shutdown()


class _HalfGone:
    """A producer's block source that claims every key but has lost every second block."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.served = 0

    def holds(self, key: str) -> bool:
        return self.inner.holds(key)

    def lookup(self, key: str) -> torch.Tensor | None:
        self.served += 1
        return self.inner.lookup(key) if self.served % 2 else None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_blocks_the_producer_lost_are_recomputed(tiny: Path, async_scheduling: bool) -> None:
    prompts = _prompts(seed=1)
    expected = _single_engine(tiny, prompts)
    producer = _engine(tiny, {"kv_role": "kv_producer", "port": _free_port()})
    server: BlockServer | None = None
    try:
        _generate(producer, prompts, PREFILL)
        store = _worker_connector(producer)._store
        server = BlockServer("tcp://127.0.0.1:0", _HalfGone(store), None)
        peer = server.address.removeprefix("tcp://")
        consumer = _engine(
            tiny, {"kv_role": "kv_consumer", "peer": peer}, async_scheduling=async_scheduling
        )
        try:
            assert _generate(consumer, prompts, GREEDY) == expected
            stats = consumer.engine.stats()
            assert stats["kv_connector_failed_load_blocks"] > 0
            assert stats["kv_connector_transfers"]["failed_loads@remote"] > 0
        finally:
            consumer.engine.shutdown()
    finally:
        if server is not None:
            server.close()
        producer.engine.shutdown()


def test_an_unreachable_producer_means_local_prefill(tiny: Path) -> None:
    prompts = _prompts(n=3, seed=2)
    expected = _single_engine(tiny, prompts)
    consumer = _engine(
        tiny, {"kv_role": "kv_consumer", "peer": f"127.0.0.1:{_free_port()}", "timeout_s": 0.2}
    )
    try:
        assert _generate(consumer, prompts, GREEDY) == expected
        assert consumer.engine.stats()["kv_connector_external_hit_tokens"] == 0
    finally:
        consumer.engine.shutdown()


class _Gated:
    """A block source whose `lookup` waits until the test opens the gate."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.gate = inner, threading.Event()

    def holds(self, key: str) -> bool:
        return self.inner.holds(key)

    def lookup(self, key: str) -> torch.Tensor | None:
        assert self.gate.wait(timeout=120), "the test never opened the gate"
        return self.inner.lookup(key)


def test_a_request_waiting_for_remote_kv_does_not_hold_up_others(tiny: Path) -> None:
    long_prompt, short_prompt = _prompts(n=1, seed=3)[0] + [7] * 40, [9, 8, 7, 6, 5]
    expected = _single_engine(tiny, [long_prompt, short_prompt])
    producer = _engine(tiny, {"kv_role": "kv_producer", "port": _free_port()})
    server: BlockServer | None = None
    try:
        _generate(producer, [long_prompt], PREFILL)
        gated = _Gated(_worker_connector(producer)._store)
        server = BlockServer("tcp://127.0.0.1:0", gated, None)
        peer = server.address.removeprefix("tcp://")
        consumer = _engine(tiny, {"kv_role": "kv_consumer", "peer": peer})
        engine = consumer.engine
        try:
            slow = make_request("slow", long_prompt, max_tokens=10, ignore_eos=True)
            fast = make_request("fast", short_prompt, max_tokens=10, ignore_eos=True)
            engine.add_request(slow)
            engine.add_request(fast)
            tokens: dict[str, list[int]] = {"slow": [], "fast": []}
            for _ in range(200):  # the fast request finishes while the slow one waits
                for out in engine.step()[0]:
                    tokens[out.request_id] += out.new_token_ids
                if fast.is_finished:
                    break
            assert fast.is_finished and tokens["fast"] == expected[1]
            assert slow.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            gated.gate.set()
            for _ in range(10_000):
                if slow.is_finished:
                    break
                for out in engine.step()[0]:
                    tokens[out.request_id] += out.new_token_ids
            assert tokens["slow"] == expected[0]
            assert engine.stats()["kv_connector_external_hit_tokens"] > 0
        finally:
            gated.gate.set()
            engine.shutdown()
    finally:
        if server is not None:
            server.close()
        producer.engine.shutdown()


def test_the_server_checks_the_token_and_the_request(tiny: Path) -> None:
    class _Empty:
        def holds(self, key: str) -> bool:
            return False

        def lookup(self, key: str) -> torch.Tensor | None:
            return None

    server = BlockServer("tcp://127.0.0.1:0", _Empty(), "secret")
    try:
        good = BlockClient(server.address, "secret", timeout_s=10)
        assert good.count(["a" * 64]) == 0
        assert good.fetch(["a" * 64]) == [None]
        with pytest.raises(TransportError, match="token"):
            BlockClient(server.address, "wrong", timeout_s=10).count(["a" * 64])
        with pytest.raises(TransportError, match="keys"):
            good._request("has", [1, 2])  # type: ignore[list-item]
        assert good.count(["b" * 64]) == 0  # the server lives on after bad requests
    finally:
        server.close()


def test_kv_transfer_config_selects_the_roles(tiny: Path) -> None:
    with pytest.raises(Exception, match="peer"):
        LLM(
            model=str(tiny),
            kv_transfer_config={"kv_connector": "kv-disagg", "kv_role": "kv_consumer"},
        )
    with pytest.raises(ConfigError, match="peer"):
        from tandem.config_resolution import resolve_config
        from tandem.plugins.kv_disagg.connector import DisaggConnector
        from tandem.stack_file import load_config

        config = resolve_config(load_config(None, model=str(tiny)))
        DisaggConnector(config, DisaggConnector.Options(kv_role="kv_consumer"))
