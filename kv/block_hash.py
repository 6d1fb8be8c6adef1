"""Chained content hashes of full KV blocks, the keys of the prefix cache.

The hash of block ``i`` of a token sequence is
``hash_block_tokens(hash_of_block_{i-1}, tokens_of_block_i)`` with ``None`` as
the parent of block 0, so it identifies the whole prefix ``tokens[0 : (i+1) *
block_size]``, not just the block's own tokens: two sequences share block ``i``'s
hash only if they share all tokens up to the end of block ``i`` (up to hash
collisions of Python's 64-bit ``hash``).
"""

from __future__ import annotations

# Stand-in for the missing parent of block 0. ``hash(None)`` is derived from the
# address of ``None`` before Python 3.12, so it differs between processes; a
# fixed integer keeps every hash a pure function of the token ids (ints hash to
# themselves, and tuple hashing is not salted by PYTHONHASHSEED).
_ROOT_PARENT: int = 0x74616E64656D  # "tandem"


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Return the chained hash of one full block.

    Args:
        parent_hash: the hash of the previous block of the same sequence, or
            ``None`` for the first block.
        token_ids: the block's token ids (exactly ``block_size`` of them for a
            cacheable block; the function itself does not check the length).

    The result is deterministic across processes and runs for int token ids.
    """
    return hash((_ROOT_PARENT if parent_hash is None else parent_hash, token_ids))
