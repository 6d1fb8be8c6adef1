"""The worker side of the offload store: block copies in host memory and in files.

A block's payload is one `[num_layers, 2, elements]` tensor (keys then values of each
layer's block, flattened in the pools' own layout and dtype), so a block round-trips
bit-exactly. A file is one JSON header line (`magic`, the payload's dtype and shape, its
CRC-32) followed by the payload bytes; it is written to a temporary name and renamed, so a
reader never sees half a file from a live writer. A file that is missing, truncated,
corrupt (CRC mismatch) or of another layout is a failed load: the caller reports the block
and the file is removed.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections import defaultdict
from pathlib import Path

import torch

from tandem.plugins.kv_offload.index import FILE_SUFFIX, OffloadPlan

logger = logging.getLogger("tandem.kv_offload")

MAGIC = "tandem-kv-block"


class BlockLoadError(Exception):
    """A stored block could not be read back as this engine's layout."""


class OffloadStore:
    """Host copies and files of blocks, applied one `OffloadPlan` at a time."""

    def __init__(self, disk_dir: Path | None, block_size: int = 0) -> None:
        self.disk_dir = disk_dir
        self.block_size = block_size
        self.host: dict[str, torch.Tensor] = {}
        #: The worker's pools (the list object itself: it may be refilled in place).
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.failed_blocks: set[int] = set()
        #: `get_kv_connector_stats` counters since the last `take_stats`, per tier.
        self.stats: defaultdict[str, float] = defaultdict(float)

    def _count(self, what: str, tier: str, started: float) -> None:
        """One block moved `what` ("loaded" or "saved") at `tier`, since `started`."""
        self.stats[f"{what}_tokens@{tier}"] += self.block_size
        seconds = "load_seconds" if what == "loaded" else "save_seconds"
        self.stats[f"{seconds}@{tier}"] += time.perf_counter() - started

    # Pool <-> payload --------------------------------------------------------------------
    def payload_of(self, block_id: int) -> torch.Tensor:
        """Block `block_id` of every layer's pools as one `[layers, 2, elements]` tensor."""
        rows = [
            torch.stack([k[block_id].reshape(-1), v[block_id].reshape(-1)])
            for k, v in self.kv_caches
        ]
        return torch.stack(rows).to("cpu")

    def _expected(self) -> tuple[torch.dtype, tuple[int, ...]]:
        k = self.kv_caches[0][0]
        return k.dtype, (len(self.kv_caches), 2, k[0].numel())

    def write_block(self, payload: torch.Tensor, block_id: int) -> None:
        """Copy a payload into block `block_id` of every layer; BlockLoadError when its dtype
        or shape is not this engine's."""
        dtype, shape = self._expected()
        if payload.dtype != dtype or tuple(payload.shape) != shape:
            raise BlockLoadError(
                f"layout {payload.dtype} {tuple(payload.shape)}, expected {dtype} {shape}"
            )
        for layer, (k, v) in enumerate(self.kv_caches):
            k[block_id].copy_(payload[layer, 0].view(k[block_id].shape))
            v[block_id].copy_(payload[layer, 1].view(v[block_id].shape))

    # Files ------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / (key + FILE_SUFFIX)

    def _write_file(self, key: str, payload: torch.Tensor) -> None:
        data = payload.contiguous().view(torch.uint8).numpy().tobytes()
        header = {
            "magic": MAGIC,
            "dtype": str(payload.dtype).removeprefix("torch."),
            "shape": list(payload.shape),
            "crc32": zlib.crc32(data),
        }
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n")
            f.write(data)
        os.replace(tmp, path)

    def _read_file(self, key: str) -> torch.Tensor:
        try:
            with open(self._path(key), "rb") as f:
                header = json.loads(f.readline())
                data = f.read()
        except (OSError, ValueError) as exc:
            raise BlockLoadError(f"unreadable: {exc}") from exc
        if not isinstance(header, dict) or header.get("magic") != MAGIC:
            raise BlockLoadError("not a tandem KV block file")
        if zlib.crc32(data) != header.get("crc32"):
            raise BlockLoadError("checksum mismatch (truncated or corrupt)")
        dtype = getattr(torch, str(header.get("dtype")), None)
        shape = header.get("shape")
        if not isinstance(dtype, torch.dtype):
            raise BlockLoadError(f"unknown dtype {header.get('dtype')!r}")
        if not isinstance(shape, list) or not all(isinstance(n, int) and n > 0 for n in shape):
            raise BlockLoadError(f"bad shape {shape!r}")
        if not data:
            raise BlockLoadError("empty payload")
        try:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(*shape)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise BlockLoadError(f"payload does not match its header: {exc}") from exc

    def holds(self, key: str) -> bool:
        """Whether host memory or the directory holds `key` (thread-safe, as `lookup`)."""
        return key in self.host or (self.disk_dir is not None and self._path(key).exists())

    def lookup(self, key: str) -> torch.Tensor | None:
        """The stored payload of `key` (host memory, then its file), or None. Safe from
        another thread beside the worker's plans: a dict read, or a file read that fails
        cleanly when the file is being replaced or removed."""
        payload = self.host.get(key)
        if payload is not None or self.disk_dir is None:
            return payload
        try:
            return self._read_file(key)
        except BlockLoadError:
            return None

    def _remove(self, key: str) -> None:
        self.host.pop(key, None)
        if self.disk_dir is not None:
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError as exc:  # a read-only store: the index forgets the key anyway
                logger.warning("cannot remove KV block file %s: %s", key[:16], exc)

    # Plans ------------------------------------------------------------------------------
    def load(self, plan: OffloadPlan) -> None:
        """Read the plan's blocks into the pools; a failure marks the block and drops the
        key from every tier."""
        for key, block_id, tier in plan.loads:
            started = time.perf_counter()
            try:
                if tier == "cpu":
                    payload = self.host.get(key)
                    if payload is None:
                        raise BlockLoadError("not in host memory")
                else:
                    payload = self._read_file(key)
                self.write_block(payload, block_id)
                self._count("loaded", tier, started)
            except BlockLoadError as exc:
                logger.warning("KV block %s (%s tier) failed to load: %s", key[:16], tier, exc)
                self.failed_blocks.add(block_id)
                self.stats[f"failed_loads@{tier}"] += 1
                self._remove(key)

    def save(self, plan: OffloadPlan) -> None:
        """Copy the plan's blocks to host memory, then apply its tier moves."""
        for key, block_id in plan.saves:
            started = time.perf_counter()
            self.host[key] = self.payload_of(block_id)
            self._count("saved", "cpu", started)
        for move, key in plan.moves:
            if move == "demote":
                started = time.perf_counter()
                payload = self.host.pop(key, None)
                if payload is not None and self.disk_dir is not None:
                    self._write_file(key, payload)
                    self._count("saved", "disk", started)
            elif move == "write":
                started = time.perf_counter()
                payload = self.host.get(key)
                if payload is not None and self.disk_dir is not None:
                    self._write_file(key, payload)
                    self._count("saved", "disk", started)
            elif move == "drop_cpu":
                self.host.pop(key, None)
            else:
                self._path(key).unlink(missing_ok=True)

    def take_stats(self) -> dict[str, float]:
        stats, self.stats = dict(self.stats), defaultdict(float)
        return stats

    def take_failures(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed
