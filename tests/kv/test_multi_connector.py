"""`kv-multi` (vLLM's MultiConnector): several KV connectors behind one.

End to end with two `kv-offload` children: greedy outputs equal a run without a connector on
a workload whose prefixes are evicted and reused, loads come from the first child that has
the blocks, saves reach every child, under sync and async scheduling and across the `mp`
process boundary; a faulty child never changes an output; blocks kept by several children
are freed once all of them reported; vLLM's `kv_transfer_config` form selects it; config
errors name the field. Unit tests drive the plugin with fake children.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from pydantic import BaseModel, ConfigDict

from tandem import LLM, SamplingParams
from tandem.core import hookimpl
from tandem.core.plugin_manager import PluginConfigError, TandemPlugin
from tandem.kv.connector import KVConnectorOutput
from tandem.plugin_discovery import register_plugin, unregister_plugin
from tandem.plugins.kv_multi_connector import MultiConnector, MultiConnectorMetadata
from tandem.plugins.kv_offload.index import OffloadPlan
from tandem.schema.config import ConfigError, EngineConfig
from tandem.testing.tiny_model import save_tiny_model

BLOCK = 16
BASE = ["reference-scheduler", "default-sampler"]
FAULTY = "tandem.testing.kv_faults:FaultyOffloadConnector"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("multi") / "llama")


def _rounds() -> list[list[list[int]]]:
    """A prompt, three unrelated prompts that push its blocks out of a 12-block pool, then
    two prompts continuing its first 64 tokens."""
    rng = random.Random(0)
    prefix = [rng.randrange(5, 200) for _ in range(64)]
    tails = [[rng.randrange(5, 200) for _ in range(8)] for _ in range(3)]
    others = [[rng.randrange(5, 200) for _ in range(60)] for _ in range(3)]
    return [[prefix + tails[0]], others, [prefix + tails[1], prefix + tails[2]]]


def _multi(*children: Any) -> dict[str, Any]:
    return {"name": "kv-multi", "options": {"connectors": list(children)}}


def _engine(model: Path, connector: dict[str, Any] | None, **kw: Any) -> LLM:
    kw.setdefault("num_kv_blocks", 12)
    return LLM(
        model=str(model),
        block_size=BLOCK,
        max_model_len=128,
        worker_num_threads=1,
        plugins=BASE if connector is None else [*BASE, connector],
        **kw,
    )


def _scheduler(llm: LLM) -> Any:
    return llm.engine.plugin_manager.plugins_with_role("scheduler")[0]


def _connector(llm: LLM) -> MultiConnector:
    return llm.engine.plugin_manager.plugins_with_role("kv-connector")[0]


def _generate(llm: LLM, rounds: list[list[list[int]]] | None = None) -> list[list[int]]:
    tokens: list[list[int]] = []
    for prompts in rounds if rounds is not None else _rounds():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outs]
    return tokens


@pytest.fixture(scope="module")
def expected(tiny: Path) -> list[list[int]]:
    llm = _engine(tiny, None)
    try:
        return _generate(llm)
    finally:
        llm.engine.shutdown()


# End to end: two kv-offload children ---------------------------------------------------
@pytest.mark.parametrize(
    ("async_scheduling", "executor"), [(False, "thread"), (True, "thread"), (True, "mp")]
)
def test_loads_come_from_the_first_child_holding_the_blocks(
    tiny: Path,
    tmp_path: Path,
    expected: list[list[int]],
    async_scheduling: bool,
    executor: str,
) -> None:
    """A 2-block host tier first (the prefix is pushed out of it), a disk tier second: the
    continuations load from the disk child; both children saved."""
    small = {"name": "kv-offload", "options": {"cpu_blocks": 2}}
    disk = {"name": "kv-offload", "options": {"cpu_blocks": 0, "disk_path": str(tmp_path)}}
    llm = _engine(tiny, _multi(small, disk), async_scheduling=async_scheduling, executor=executor)
    try:
        assert _generate(llm) == expected
        first, second = (child.instance for child in _connector(llm).children)
        link = _scheduler(llm).kv_link
        assert link.stats["external_hit_tokens"] >= 4 * BLOCK
        assert link.stats["failed_load_blocks"] == 0
        assert not first.loaded_key and len(second.loaded_key) >= 4
        assert len(first.index.cpu) == 2 and len(second.index.disk) > 4
        assert len(list(tmp_path.rglob("*.kv"))) == len(second.index.disk)
        assert _scheduler(llm).kv_cache_manager.all_blocks_free()
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_first_child_holding_the_blocks_answers(
    tiny: Path, tmp_path: Path, expected: list[list[int]], async_scheduling: bool
) -> None:
    """Both children hold the prefix: the first loads it, the second saved it too."""
    host = {"name": "kv-offload", "options": {"cpu_blocks": 64}}
    disk = {"name": "kv-offload", "options": {"cpu_blocks": 0, "disk_path": str(tmp_path)}}
    llm = _engine(tiny, _multi(host, disk), async_scheduling=async_scheduling)
    try:
        assert _generate(llm) == expected
        first, second = (child.instance for child in _connector(llm).children)
        assert len(first.loaded_key) >= 4 and not second.loaded_key
        assert set(first.index.cpu) == set(second.index.disk)  # every block in both
        assert list(tmp_path.rglob("*.kv"))
    finally:
        llm.engine.shutdown()


def _fuzz_rounds(seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 250) for _ in range(rng.randrange(32, 80))] for _ in range(3)]
    return [
        [
            rng.choice(prefixes) + [rng.randrange(5, 250) for _ in range(rng.randrange(1, 20))]
            for _ in range(rng.randrange(1, 4))
        ]
        for _ in range(5)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_faulty_child_never_changes_an_output(tiny: Path, async_scheduling: bool) -> None:
    """A store failing loads and losing saves, first or second, beside a small healthy one:
    a block whose load failed is never saved by the other child (it holds garbage)."""
    failed = 0
    for seed in range(3):
        rounds = _fuzz_rounds(seed)
        plain = _engine(tiny, None, async_scheduling=async_scheduling)
        try:
            want = _generate(plain, rounds)
        finally:
            plain.engine.shutdown()
        faulty = {
            "name": FAULTY,
            "options": {"cpu_blocks": 64, "fail_load_fraction": 0.4, "lose_save_fraction": 0.1},
        }
        healthy = {"name": "kv-offload", "options": {"cpu_blocks": 6}}
        children = (faulty, healthy) if seed % 2 == 0 else (healthy, faulty)
        llm = _engine(tiny, _multi(*children), async_scheduling=async_scheduling)
        try:
            assert _generate(llm, rounds) == want, f"seed {seed}"
            failed += _scheduler(llm).kv_link.stats["failed_load_blocks"]
            assert _scheduler(llm).kv_cache_manager.all_blocks_free()
        finally:
            llm.engine.shutdown()
    assert failed > 0, "the faults must reach the rollback path"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_block_whose_load_failed_is_not_saved_by_another_child(
    tiny: Path, tmp_path: Path, async_scheduling: bool
) -> None:
    """The first child holds the prefix (files of a previous engine) and fails every load;
    the second, empty, must not store the garbage those blocks held before they were
    recomputed: the last continuation, loaded from the second child, gets the right tokens."""
    prefix_round, others, continuations = _rounds()
    store = {"cpu_blocks": 0, "disk_path": str(tmp_path)}
    previous = _engine(tiny, {"name": "kv-offload", "options": store})
    try:
        _generate(previous, [prefix_round])
    finally:
        previous.engine.shutdown()
    rounds = [[continuations[0]], others, [continuations[1]]]
    plain = _engine(tiny, None, async_scheduling=async_scheduling)
    try:
        want = _generate(plain, rounds)
    finally:
        plain.engine.shutdown()
    # 5 files: the unrelated prompts push the recomputed prefix out of the first child
    failing = {"name": FAULTY, "options": {**store, "disk_blocks": 5, "fail_load_fraction": 1.0}}
    healthy = {"name": "kv-offload", "options": {"cpu_blocks": 64}}
    llm = _engine(tiny, _multi(failing, healthy), async_scheduling=async_scheduling)
    try:
        assert _generate(llm, rounds) == want
        assert _scheduler(llm).kv_link.stats["failed_load_blocks"] >= 4
        assert len(_connector(llm).children[1].instance.loaded_key) >= 4  # it served them
    finally:
        llm.engine.shutdown()


# Kept blocks ----------------------------------------------------------------------------
#: (event, tag, request id) in the order they happened (in-process executors only).
EVENTS: list[tuple[str, str, str]] = []


class KeepingConnector(TandemPlugin):
    """Keeps every finished request's blocks (but those of a 1-token request) and reports
    it in `finished_sending` `delay` steps after the worker hears it finished."""

    role = "kv-connector"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        tag: str
        delay: int = 1

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, KeepingConnector.Options)
        self.tag, self.delay = options.tag, options.delay
        self.countdown: dict[str, int] = {}
        self.seen: set[str] = set()

    @hookimpl
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict] | None:
        if request.sampling_params.max_tokens == 1:
            return None
        return True, {self.tag: request.request_id, "shared": self.tag}

    @hookimpl
    def update_connector_output(self, connector_output: Any) -> None:
        for request_id in sorted(connector_output.finished_sending):
            EVENTS.append(("freed", self.tag, request_id))

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done = set()
        for request_id in list(self.countdown):
            self.countdown[request_id] -= 1
            if not self.countdown[request_id]:
                del self.countdown[request_id]
                done.add(request_id)
                EVENTS.append(("sent", self.tag, request_id))
        for request_id in finished_req_ids:  # every finished request, kept or not
            self.countdown[request_id] = self.delay
        return done, set()


@pytest.fixture
def keeper() -> Iterator[str]:
    register_plugin("test-keeper", KeepingConnector)
    EVENTS.clear()
    yield "test-keeper"
    unregister_plugin("test-keeper")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_kept_blocks_are_freed_once_every_keeping_child_reported(
    tiny: Path, expected: list[list[int]], keeper: str, async_scheduling: bool
) -> None:
    children = (
        {"name": keeper, "options": {"tag": "fast", "delay": 1}},
        {"name": "kv-offload", "options": {"cpu_blocks": 64}},
        {"name": keeper, "options": {"tag": "slow", "delay": 3}},
    )
    llm = _engine(tiny, _multi(*children), async_scheduling=async_scheduling, num_kv_blocks=40)
    try:
        assert _generate(llm) == expected
        link, one_token = _scheduler(llm).kv_link, SamplingParams(max_tokens=1)
        for _ in range(12):  # steps after the last request: the workers report it
            if not link.kept:
                break
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], one_token, use_tqdm=False)
        assert not link.kept
        assert _scheduler(llm).kv_cache_manager.all_blocks_free(), "a block leaked"
    finally:
        llm.engine.shutdown()
    kept = {str(i) for i in range(6)}  # LLM numbers requests 0.. in order; then the 1-token ones
    assert kept <= {r for event, _, r in EVENTS if event == "sent"}
    for request_id in kept:
        order = [(e, t) for e, t, r in EVENTS if r == request_id]
        assert order.count(("freed", "fast")) == 1 and order.count(("freed", "slow")) == 1
        freed = order.index(("freed", "fast"))
        assert order.index(("sent", "fast")) < order.index(("sent", "slow")) < freed


# Configuration ---------------------------------------------------------------------------
def test_vllm_kv_transfer_config_selects_it(tiny: Path, tmp_path: Path) -> None:
    child = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    llm = LLM(
        model=str(tiny),
        kv_transfer_config={
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "connectors": [
                    {**child, "kv_connector_extra_config": {"cpu_blocks": 8}},
                    {**child, "kv_connector_extra_config": {"disk_path": str(tmp_path)}},
                ]
            },
        },
    )
    try:
        assert "kv-multi" in [name for name, _ in llm.engine.plugin_manager.stack]
        children = _connector(llm).children
        assert [c.name for c in children] == ["kv-offload", "kv-offload"]
        assert children[0].instance.options.cpu_blocks == 8
        assert children[1].instance.disk_dir is not None
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    ("connectors", "message"),
    [
        ([], r"connectors"),
        (["default-sampler"], r"plugins: kv-multi\.connectors\[0\]\.name: 'default-sampler' "),
        (["kv-offload", "kv-multi"], r"kv-multi\.connectors\[1\]\.name: 'kv-multi'.*itself"),
        (["NoSuchConnector"], r"kv-multi\.connectors\[0\]\.name: unknown plugin"),
        (
            [{"name": "kv-offload", "options": {"cpu_block": 1}}],
            r"kv-multi\.connectors\[0\]\.options: cpu_block",
        ),
        ([{"kv_connector": "OffloadingConnector", "kv_role": "sender"}], r"kv_role"),
        ([{"name": "kv-offload", "kv_connector": "kv-offload"}], r"either name"),
    ],
)
def test_config_errors_name_the_field(tiny: Path, connectors: list[Any], message: str) -> None:
    with pytest.raises((ConfigError, PluginConfigError), match=message):
        LLM(model=str(tiny), plugins=[*BASE, _multi(*connectors)])


def test_a_stack_has_one_connector_even_with_kv_multi(tiny: Path) -> None:
    with pytest.raises(PluginConfigError, match="at most one kv-connector"):
        LLM(model=str(tiny), plugins=[*BASE, "kv-offload", _multi("kv-offload")])


# Unit: fake children --------------------------------------------------------------------
class FakeChild(TandemPlugin):
    """Answers `found` tokens for every request; records every call."""

    role = "kv-connector"

    class Options(BaseModel):
        found: int = 0
        keep: bool = False
        stats: dict[str, float] = {}
        errors: list[int] = []

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, FakeChild.Options)
        self.opts = options
        self.calls: list[tuple[str, Any]] = []
        self.sending: set[str] = set()

    @hookimpl
    def get_num_new_matched_tokens(self, request: Any) -> tuple[int, bool]:  # a subset
        return self.opts.found, False

    @hookimpl
    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.calls.append(("alloc", (request.request_id, list(block_ids), num_external_tokens)))

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return {"plan": len(self.calls)}

    @hookimpl
    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        return (True, {"by": id(self)}) if self.opts.keep else None

    @hookimpl
    def start_load_kv(self, metadata: Any) -> None:
        self.calls.append(("load", metadata))

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, self.sending = self.sending, set()
        return sending, set()

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.opts.errors)

    @hookimpl
    def get_kv_connector_stats(self) -> dict[str, float]:
        return dict(self.opts.stats)


@pytest.fixture
def fake() -> Iterator[str]:
    register_plugin("test-fake-child", FakeChild)
    yield "test-fake-child"
    unregister_plugin("test-fake-child")


def _make(fake: str, *options: dict[str, Any]) -> tuple[MultiConnector, list[FakeChild]]:
    specs = [{"name": fake, "options": o} for o in options]
    multi = MultiConnector(EngineConfig(), MultiConnector.Options(connectors=specs))
    return multi, [c.instance for c in multi.children]


def _request(request_id: str, num_computed_tokens: int) -> Any:
    return SimpleNamespace(request_id=request_id, num_computed_tokens=num_computed_tokens)


def _step(
    new: tuple[tuple[str, list[int]], ...] = (), preempted: frozenset[str] = frozenset()
) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b) for r, b in new],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={r: 1 for r, _ in new},
        preempted_req_ids=set(preempted),
    )


def test_the_first_nonzero_child_loads_and_the_others_learn_after_the_load(fake: str) -> None:
    multi, (none, first, second) = _make(fake, {}, {"found": 16}, {"found": 32})
    request = _request("a", 0)
    assert multi.get_num_new_matched_tokens(request, 0) == (16, False)
    assert multi.get_num_new_matched_tokens(request, 0) == (16, False)  # asked again: same
    request.num_computed_tokens = 16
    multi.update_state_after_alloc(request, [7, 8], 16)
    assert first.calls == [("alloc", ("a", [7, 8], 16))]
    assert none.calls == second.calls == []  # block 7 is loading: not to be saved yet
    other = _request("b", 16)  # a local hit on block 7 while it loads waits as well
    multi.update_state_after_alloc(other, [7, 9], 0)
    assert first.calls[-1][0] == "alloc" and len(first.calls) == 1
    meta = multi.build_connector_meta(_step((("a", [7, 8]), ("b", [7, 9]))))
    assert meta is not None and len(meta.children) == 3
    assert none.calls == []
    multi.update_connector_output(KVConnectorOutput())  # the loading step reported
    multi.build_connector_meta(_step())
    assert none.calls == [("alloc", ("a", [7, 8], 0)), ("alloc", ("b", [7, 9], 0))]
    assert second.calls == none.calls
    assert first.calls[1:] == [("alloc", ("b", [7, 9], 0))]


def test_a_preempted_deferred_request_is_told_when_admitted_again(fake: str) -> None:
    multi, (first, second) = _make(fake, {"found": 16}, {})
    request = _request("a", 16)
    multi.get_num_new_matched_tokens(request, 0)
    multi.update_state_after_alloc(request, [3, 4], 16)
    multi.build_connector_meta(_step((("a", [3, 4]),)))
    multi.build_connector_meta(_step(preempted=frozenset({"a"})))
    multi.update_connector_output(KVConnectorOutput())
    multi.build_connector_meta(_step())
    assert second.calls == []
    request.num_computed_tokens = 0
    multi.get_num_new_matched_tokens(request, 0)
    multi.update_state_after_alloc(request, [5, 6], 0)  # no block of it loads any more
    assert second.calls == [("alloc", ("a", [5, 6], 0))]


def test_finished_sending_waits_for_every_keeping_child(fake: str) -> None:
    multi, (a, b, c) = _make(fake, {"keep": True}, {}, {"keep": True})
    kept, params = multi.request_finished(_request("r", 0), [1, 2])
    assert kept and params is not None and params["by"] == id(a)
    meta = multi.build_connector_meta(_step())
    assert meta is not None and meta.kept == {"r": 2}
    multi.start_load_kv(meta)
    a.sending = {"r"}
    assert multi.get_finished({"r"}) == (set(), set())
    a.sending = {"r"}  # the same child again does not count twice
    assert multi.get_finished(set()) == (set(), set())
    c.sending = {"r"}
    assert multi.get_finished(set()) == ({"r"}, set())
    b.sending = {"x"}  # kept by no count: passes through
    assert multi.get_finished(set()) == ({"x"}, set())
    assert multi.request_finished(_request("s", 0), [3]) is not None
    assert _make(fake, {})[0].request_finished(_request("t", 0), [4]) is None  # none keeps


def test_the_plan_survives_messagepack_and_children_get_their_part(fake: str) -> None:
    multi, children = _make(fake, {}, {})
    plan = OffloadPlan(loads=[("k", 3, "cpu")], saves=[("j", 4)])
    meta = MultiConnectorMetadata([plan, None], {"r": 2})
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(meta))
    assert isinstance(wire, dict)
    multi.start_load_kv(wire)
    assert OffloadPlan.of(children[0].calls[-1][1]) == plan
    assert children[1].calls[-1] == ("load", None)
    assert multi._expected == {"r": 2}
    multi.start_load_kv(None)
    assert [c.calls[-1] for c in children] == [("load", None), ("load", None)]


def test_errors_are_united_and_stats_summed(fake: str) -> None:
    multi, _ = _make(
        fake,
        {"errors": [1, 2], "stats": {"loaded_tokens@cpu": 16, "load_seconds": 0.5}},
        {"errors": [2, 5], "stats": {"loaded_tokens@cpu": 32, "saved_tokens@disk": 8}},
        {},
    )
    assert multi.get_block_ids_with_load_errors() == {1, 2, 5}
    assert multi.get_kv_connector_stats() == {
        "loaded_tokens@cpu": 48,
        "load_seconds": 0.5,
        "saved_tokens@disk": 8,
    }
