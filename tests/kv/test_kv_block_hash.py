"""hash_block_tokens: chained, content-addressed, reproducible."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tandem.kv import block_hash, hash_block_tokens


def chain(tokens: list[int], block_size: int) -> list[int]:
    out: list[int] = []
    parent: int | None = None
    for i in range(len(tokens) // block_size):
        parent = hash_block_tokens(parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return out


def test_same_tokens_same_parent_same_hash() -> None:
    assert hash_block_tokens(None, (1, 2, 3)) == hash_block_tokens(None, (1, 2, 3))
    assert hash_block_tokens(7, (1, 2)) == hash_block_tokens(7, (1, 2))


def test_block_hash_depends_on_the_whole_prefix() -> None:
    a = chain([1, 2, 3, 4, 5, 6], 2)
    b = chain([9, 9, 3, 4, 5, 6], 2)
    # Same tokens in blocks 1 and 2, different block 0: every hash differs.
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_shared_prefix_shares_hashes_until_first_difference() -> None:
    a = chain([1, 2, 3, 4, 5, 6], 2)
    b = chain([1, 2, 3, 4, 0, 6], 2)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_hash_is_reproducible_across_processes_with_different_hash_seeds(
    tmp_path: Path,
) -> None:
    # The child loads block_hash.py by path (it imports nothing from tandem), so
    # the check does not depend on how the package is installed.
    code = (
        "import runpy, sys;"
        "h = runpy.run_path(sys.argv[1])['hash_block_tokens'];"
        "print(h(h(None, (1, 2)), (3, 4)))"
    )
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run(
            [sys.executable, "-c", code, block_hash.__file__],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        outs.add(res.stdout.strip())
    assert outs == {str(hash_block_tokens(hash_block_tokens(None, (1, 2)), (3, 4)))}
