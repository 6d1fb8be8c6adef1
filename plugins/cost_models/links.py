"""KV-connector transfer links and their time, for the cost models (`roofline`).

A KV connector (`kv/connector`) moves whole KV blocks over one of two links:

- **host**: between the device and this host's memory, a PCIe x16 link per GPU
  (`kv-offload`'s host tier; its disk tier too: a block read from disk crosses the same
  link, the disk's own speed is not modelled). `HOST_LINK_BANDWIDTH`: the datasheets'
  PCIe figure per direction (A100 SXM: PCIe 4.0, 64 GB/s both ways; H100/H200 SXM: PCIe
  5.0, 128 GB/s both ways; B200 taken as PCIe 5.0 like the HGX B200 host side, an
  assumption). On `cpu` the pools are in host memory: a copy at half the measured
  read+write bandwidth.
- **network**: between two instances (`kv-disagg`'s remote loads, prefill engine to
  decode engine): `DEFAULT_NETWORK_BANDWIDTH`, 50 GB/s per direction (one 400 Gb/s NIC per
  GPU, as DGX H100 and HGX B200 systems have), configurable.

A block is `ModelShape.kv_bytes_per_token() x block_size` bytes: 2 (K and V) x layers x
KV heads x head_dim x block_size x dtype bytes, summed over the attention groups (the
bundled connectors run on one rank: the whole block crosses one link). A transfer of n
blocks takes n x block bytes / (bandwidth x `efficiency`); no per-transfer latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.worker.step_shape import StepShape
from tandem.plugins.cost_models.shapes import DeviceSpec, ModelShape

#: Device-to-host link bytes/s per direction, by device name (module docstring).
HOST_LINK_BANDWIDTH: dict[str, float] = {
    "a100": 32e9,  # PCIe 4.0 x16
    "h100": 64e9,  # PCIe 5.0 x16
    "h200": 64e9,  # PCIe 5.0 x16
    "b200": 64e9,  # PCIe 5.0 x16 (assumed, see the module docstring)
}
#: Bytes/s per direction between two instances: one 400 Gb/s NIC.
DEFAULT_NETWORK_BANDWIDTH = 50e9
#: Fraction of a link's peak a block copy reaches (pinned-memory copies of 0.1-1 MB).
DEFAULT_TRANSFER_EFFICIENCY = 0.8
#: The terms `transfer_seconds` returns, in order.
TRANSFER_TERMS: tuple[str, ...] = ("kv_load", "kv_save", "kv_remote")


def host_link_bandwidth(device: DeviceSpec) -> float:
    """The device's host link, bytes/s per direction (`HOST_LINK_BANDWIDTH`; another
    device, e.g. `cpu`: half its memory bandwidth, a copy within host memory)."""
    return HOST_LINK_BANDWIDTH.get(device.name, device.mem_bandwidth / 2)


@dataclass(frozen=True, slots=True)
class TransferLinks:
    """The two links' bandwidths (bytes/s per direction, > 0) and the fraction of them a
    transfer reaches (`efficiency`, in (0, 1])."""

    host_bandwidth: float
    network_bandwidth: float = DEFAULT_NETWORK_BANDWIDTH
    efficiency: float = DEFAULT_TRANSFER_EFFICIENCY

    def __post_init__(self) -> None:
        if not self.host_bandwidth > 0 or not self.network_bandwidth > 0:
            raise ValueError(
                "host_bandwidth and network_bandwidth: expected bytes/s > 0, got "
                f"{self.host_bandwidth} and {self.network_bandwidth}"
            )
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"transfer_efficiency: expected (0, 1], got {self.efficiency}")

    @classmethod
    def for_device(
        cls,
        device: DeviceSpec,
        host_bandwidth: float | None = None,
        network_bandwidth: float = DEFAULT_NETWORK_BANDWIDTH,
        efficiency: float = DEFAULT_TRANSFER_EFFICIENCY,
    ) -> TransferLinks:
        """The device's links; `host_bandwidth` None: `host_link_bandwidth(device)`."""
        host = host_bandwidth if host_bandwidth is not None else host_link_bandwidth(device)
        return cls(host, network_bandwidth, efficiency)


def kv_block_bytes(shape: ModelShape, block_size: int) -> float:
    """Bytes of one KV block of `block_size` tokens (all layers, K and V)."""
    return float(shape.kv_bytes_per_token() * block_size)


def transfer_seconds(shape: ModelShape, step: StepShape, links: TransferLinks) -> dict[str, float]:
    """Seconds of the step's connector transfers, by `TRANSFER_TERMS`: local loads and
    saves over the host link, remote loads over the network (0.0 each without blocks)."""
    block = kv_block_bytes(shape, step.kv_block_size)
    host = links.host_bandwidth * links.efficiency
    network = links.network_bandwidth * links.efficiency
    return {
        "kv_load": step.kv_load_blocks * block / host,
        "kv_save": step.kv_save_blocks * block / host,
        "kv_remote": step.kv_remote_blocks * block / network,
    }
