"""Content keys of KV blocks for a store that outlives one process.

The key of block i of a token sequence is sha256(key of block i-1, the block's token ids),
rooted in the engine's `signature` (model files, dtype, block size, ranks): it names the
whole prefix up to the block's end, is the same in every process and every run, and two
engines share a key only when they would compute the same KV for it. 64 hex characters,
so it is also a safe file name.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STORE_VERSION = 1


def engine_signature(config: Any) -> str:
    """What must match for stored KV to be valid here: the model (its path and, for a
    directory, each file's name, size and modification time), the compute dtype, the block
    size and the parallel layout; as a 16-hex-digit digest."""
    model = config.model.model
    files: list[tuple[str, int, int]] = []
    path = Path(model)
    if path.is_dir():
        for entry in sorted(path.iterdir()):
            if entry.is_file():
                stat = entry.stat()
                files.append((entry.name, stat.st_size, stat.st_mtime_ns))
    described = {
        "version": STORE_VERSION,
        "model": os.path.abspath(model) if path.exists() else model,
        "files": files,
        "dtype": config.model.dtype,
        "block_size": config.cache.block_size,
        "tp": config.parallel.tensor_parallel_size,
        "pp": config.parallel.pipeline_parallel_size,
    }
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def extend_keys(
    keys: list[str], signature: str, token_ids: Sequence[int], block_size: int, num_blocks: int
) -> list[str]:
    """`keys` (the first blocks' keys) extended in place to `num_blocks` keys."""
    parent = keys[-1] if keys else signature
    for i in range(len(keys), num_blocks):
        tokens = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        parent = hashlib.sha256(parent.encode() + tokens).hexdigest()
        keys.append(parent)
    return keys
