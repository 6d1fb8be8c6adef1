"""KV-connector transfer time on the virtual clock.

The roofline prices a step's connector blocks at block bytes / (link bandwidth x
efficiency), exactly; a simulated `kv-offload` run charges the device exactly that for the
blocks its plans moved (the engine's own transfer counters); prefix hits from the offload
store shorten TTFT against recomputation at PCIe speed and lengthen it over an absurdly
slow link; `load_async` loads complete on the oracle; a remote (disaggregated) load runs
beside the steps: the request is ready when its network transfer ends, and the device's
busy time does not include it.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from tandem.core import hookimpl
from tandem.core.clock import VirtualClock
from tandem.core.engine_core import EngineCore
from tandem.core.plugin_manager import TandemPlugin
from tandem.core.worker.connector_plan import (
    ConnectorTransfers,
    RemoteLoads,
    connector_transfers,
)
from tandem.core.worker.step_shape import StepShape
from tandem.core.worker.virtual_device import EngineTime, VirtualDeviceExecutor
from tandem.plugins.cost_models.links import HOST_LINK_BANDWIDTH, TransferLinks, kv_block_bytes
from tandem.plugins.cost_models.roofline import RooflineCostModel, breakdown
from tandem.plugins.cost_models.shapes import NAMED_DEVICES, model_shape
from tandem.plugins.kv_multi_connector import MultiConnectorMetadata
from tandem.plugins.kv_offload.index import OffloadPlan
from tandem.schema.config import EngineConfig
from tandem.simulate.driver import make_request, simulate, simulation_config
from tandem.simulate.traffic import TrafficRequest
from tandem.stack_file import load_config
from tandem.testing.engine import scripted_config

LLAMA = model_shape("llama-3-8b")
#: Llama-3-8B bf16, 16-token blocks: 32 layers x 2 x 8 KV heads x 128 x 16 x 2 bytes.
LLAMA_BLOCK = 32 * 2 * 8 * 128 * 16 * 2


# Reading the plans -------------------------------------------------------------------


def test_connector_plans_are_counted() -> None:
    plan = OffloadPlan(
        loads=[("k1", 3, "cpu"), ("k2", 4, "disk")],
        saves=[("k3", 5)],
        moves=[("demote", "k0")],
        recv=["r1"],
    )
    expected = ConnectorTransfers(load_blocks=2, save_blocks=1, recv=("r1",))
    assert connector_transfers(plan) == expected
    wire = {"loads": [["k1", 3, "cpu"], ["k2", 4, "disk"]], "saves": [["k3", 5]], "recv": ["r1"]}
    assert connector_transfers(wire) == expected
    disagg = {"offload": plan, "remote": [["r2", [["a", 1], ["b", 2], ["c", 6]]]]}
    assert connector_transfers(disagg) == ConnectorTransfers(2, 1, ("r1",), (("r2", 3),))
    multi = MultiConnectorMetadata([plan, None, {"saves": [["k9", 9]]}])
    assert connector_transfers(multi) == ConnectorTransfers(2, 2, ("r1",))
    assert connector_transfers(None) == ConnectorTransfers()
    assert connector_transfers([7, 8]) == ConnectorTransfers()  # an unknown plan moves nothing


def test_remote_loads_run_one_after_another() -> None:
    loads = RemoteLoads()
    assert loads.start("a", 1.0, 0.5) == 1.5
    assert loads.start("b", 1.2, 0.5) == 2.0  # waits for a
    assert loads.start("c", 3.0, 0.1) == pytest.approx(3.1)
    assert loads.next_end == 1.5
    assert loads.finished_by(1.99) == {"a"}
    assert loads.finished_by(2.0) == {"b"} and loads.finished_by(2.5) == set()
    assert loads.next_end == pytest.approx(3.1)


# Pricing -------------------------------------------------------------------------------


def roofline(**options: Any) -> RooflineCostModel:
    config = EngineConfig.model_validate(scripted_config())
    opts = RooflineCostModel.Options(**({"model": "llama-3-8b", "device": "h100"} | options))
    return RooflineCostModel(config, opts)


def test_a_constructed_step_is_charged_its_blocks_over_the_host_link() -> None:
    assert kv_block_bytes(LLAMA, 16) == LLAMA_BLOCK == 2_097_152
    model = roofline()
    plain = StepShape((1, 1), (100, 200), 2)
    moving = StepShape((1, 1), (100, 200), 2, kv_load_blocks=3, kv_save_blocks=2)
    h100_pcie = 64e9 * 0.8
    assert HOST_LINK_BANDWIDTH["h100"] == 64e9
    terms = model.breakdown(moving)
    assert terms["kv_load"] == 3 * LLAMA_BLOCK / h100_pcie  # 122.9 us
    assert terms["kv_save"] == 2 * LLAMA_BLOCK / h100_pcie
    assert terms["kv_remote"] == 0.0
    extra = model.step_cost(step=moving) - model.step_cost(step=plain)
    assert extra == pytest.approx(5 * LLAMA_BLOCK / h100_pcie, rel=1e-12)
    slow = roofline(host_bandwidth=1e9, transfer_efficiency=0.5)
    extra = slow.step_cost(step=moving) - slow.step_cost(step=plain)
    assert extra == pytest.approx(5 * LLAMA_BLOCK / 0.5e9, rel=1e-12)  # 21 ms


def test_transfers_alone_and_remote_loads() -> None:
    model = roofline(network_bandwidth=10e9)
    remote = StepShape((), (), kv_remote_blocks=7)
    assert model.step_cost(step=remote) == 7 * LLAMA_BLOCK / (10e9 * 0.8)
    alone = StepShape((), (), kv_load_blocks=4, kv_block_size=32)
    assert model.step_cost(step=alone) == 4 * 2 * LLAMA_BLOCK / (64e9 * 0.8)
    assert model.step_cost(step=StepShape((), ())) == 0.0
    a100 = breakdown(LLAMA, NAMED_DEVICES["a100"], StepShape((), (), kv_save_blocks=1))
    assert a100["kv_save"] == LLAMA_BLOCK / (32e9 * 0.8) and a100["linear"] == 0.0
    with pytest.raises(ValueError, match="host_bandwidth"):
        TransferLinks(0.0)


# Simulated runs ------------------------------------------------------------------------


def offload_stack(
    connector: dict[str, Any] | None = None,
    extra: tuple[str, ...] = (),
    max_num_seqs: int = 8,
    **cost: Any,
) -> EngineConfig:
    plugins: list[Any] = [
        "reference-scheduler",
        "default-sampler",
        {"name": "roofline-cost", "options": {"model": "llama-3-8b", "device": "h100"} | cost},
    ]
    if connector is not None:
        plugins.append({"name": "kv-offload", "options": connector})
    plugins += extra
    return load_config(
        model="scripted",
        max_model_len=2048,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        block_size=16,
        num_kv_blocks=512,
        enable_prefix_caching=False,
        plugins=plugins,
    )


def shared_prefix(n: int = 5, gap_s: float = 0.5) -> list[TrafficRequest]:
    """Requests one after another, each 1100 tokens of which the first 1024 are shared."""
    return [
        TrafficRequest(gap_s * i, 1100, 4, prefix_group=0, prefix_tokens=1024) for i in range(n)
    ]


def run_engine(config: EngineConfig, traffic: list[TrafficRequest]) -> tuple[float, dict[str, Any]]:
    """All requests at once through the engine on the virtual device (no engine time: the
    schedule cannot depend on the clock); (device busy seconds, engine stats)."""
    config = simulation_config(config)
    clock = VirtualClock()
    executor = VirtualDeviceExecutor(config, clock)
    engine = EngineCore(config, executor=executor, clock=clock)
    try:
        for i, entry in enumerate(traffic):
            engine.add_request(make_request(entry, i, 128, 1, 0))
        engine.run_until_idle()
        return executor.busy_s, engine.stats()
    finally:
        engine.shutdown()


def test_a_run_is_charged_exactly_the_blocks_its_plans_moved() -> None:
    """Same schedule at two host bandwidths (max_num_seqs 1, all arrived at 0): the busy
    time differs by exactly (loaded + saved blocks) x block bytes x (1/bw1 - 1/bw2)."""
    traffic = [TrafficRequest(0.0, 1100, 4, 0, 0, 1024) for _ in range(4)]
    runs = {
        bw: run_engine(
            offload_stack({"cpu_blocks": 1024}, max_num_seqs=1, host_bandwidth=bw), traffic
        )
        for bw in (1e9, 4e9)
    }
    transfers = runs[1e9][1]["kv_connector_transfers"]
    assert transfers == runs[4e9][1]["kv_connector_transfers"]
    loaded, saved = transfers["loaded_tokens"], transfers["saved_tokens"]
    # the first request saves its 68 full blocks; the others load the 64 shared blocks
    # and save their own 4
    assert (loaded, saved) == (3 * 64 * 16, (68 + 3 * 4) * 16)
    blocks = (loaded + saved) / 16
    expected = blocks * LLAMA_BLOCK * (1 / (1e9 * 0.8) - 1 / (4e9 * 0.8))
    assert runs[1e9][0] - runs[4e9][0] == pytest.approx(expected, rel=1e-9)


def ttfts(config: EngineConfig, traffic: list[TrafficRequest]) -> list[float]:
    result = simulate(config, traffic, engine_time=EngineTime(step_s=2e-4))
    assert all(len(t.token_times_s) == 4 for t in result.timelines)
    return [t.token_times_s[0] - t.arrival_s for t in result.timelines]


@pytest.mark.parametrize("load_async", [False, True])
def test_offload_hits_shorten_ttft_over_pcie_and_lengthen_it_over_a_slow_link(
    load_async: bool,
) -> None:
    """Without a local prefix cache, the second and later requests either recompute the
    shared 1024 tokens (no connector) or load 64 blocks (128 MiB) from the host tier: 2.6
    ms over H100 PCIe against ~20 ms of prefill; at 100 MB/s, 1.6 s."""
    traffic = shared_prefix()
    recompute = ttfts(offload_stack(), traffic)
    fast = ttfts(offload_stack({"cpu_blocks": 1024, "load_async": load_async}), traffic)
    slow = ttfts(
        offload_stack({"cpu_blocks": 1024, "load_async": load_async}, host_bandwidth=1e8), traffic
    )
    assert recompute[1:] == pytest.approx([recompute[1]] * 4)  # every one recomputes
    for r, f, s in zip(recompute[1:], fast[1:], slow[1:], strict=True):
        assert f < 0.5 * r
        assert s > r + 64 * LLAMA_BLOCK / (1e8 * 0.8) * 0.9
    assert fast[0] > recompute[0]  # the first request pays for its saves


# A remote (disaggregated) load -------------------------------------------------------


class RemotePrefill(TandemPlugin):
    """Scheduler side of a `kv-disagg`-like consumer: claims every whole prompt block as held
    by a producer and plans remote loads in `kv-disagg`'s plan shape."""

    role = "kv-connector"

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        self.block_size = config.cache.block_size
        self.remote: dict[str, list[list[Any]]] = {}

    @hookimpl
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        whole = (request.num_tokens - 1) // self.block_size * self.block_size
        return (whole - num_computed_tokens, True) if whole > num_computed_tokens else (0, False)

    @hookimpl
    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            bs = self.block_size
            end = request.num_computed_tokens // bs
            first = end - num_external_tokens // bs
            self.remote[request.request_id] = [[f"k{i}", block_ids[i]] for i in range(first, end)]

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> dict[str, Any] | None:
        loads, self.remote = self.remote, {}
        return {"remote": [[rid, pairs] for rid, pairs in loads.items()]} if loads else None


def remote_stack(network_bandwidth: float) -> EngineConfig:
    return offload_stack(extra=(f"{__name__}:RemotePrefill",), network_bandwidth=network_bandwidth)


def test_a_remote_load_runs_beside_the_steps() -> None:
    """One request of 1100 tokens: its 68 whole blocks come over the network (asynchronous:
    WAITING_FOR_REMOTE_KVS), then 12 tokens are computed. TTFT moves by exactly the
    difference of the two transfer times; the device's busy time does not change."""
    traffic = [TrafficRequest(0.0, 1100, 4)]
    runs = {bw: simulate(remote_stack(bw), traffic) for bw in (1e9, 50e9)}
    ttft = {bw: r.timelines[0].token_times_s[0] for bw, r in runs.items()}
    load = {bw: 68 * LLAMA_BLOCK / (bw * 0.8) for bw in runs}  # 178 ms and 3.6 ms
    assert ttft[1e9] - ttft[50e9] == pytest.approx(load[1e9] - load[50e9], rel=1e-9)
    assert ttft[50e9] > load[50e9]
    assert runs[1e9].busy_s == pytest.approx(runs[50e9].busy_s, rel=1e-12)
    recompute = simulate(offload_stack(), traffic)  # 1100 tokens of prefill: ~27 ms
    assert ttft[50e9] < recompute.timelines[0].token_times_s[0]
    assert runs[1e9].timelines[0].finish_reason == "length"


def test_other_requests_run_while_a_remote_load_is_in_flight() -> None:
    """A slow remote load (1.4 s) does not hold up a request that arrives after it and has
    nothing remote to load (prompt under one block): it finishes long before."""
    traffic = [TrafficRequest(0.0, 1100, 4), TrafficRequest(0.01, 10, 4)]
    result = simulate(remote_stack(1e8), traffic)
    long, short = result.timelines
    assert short.finish_s is not None and long.finish_s is not None
    assert short.finish_s < 0.2 < 68 * LLAMA_BLOCK / (1e8 * 0.8) < long.token_times_s[0]
