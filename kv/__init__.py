"""Paged KV-cache bookkeeping for the scheduler: blocks, the free queue, the
block pool with its prefix cache, chained block hashes, and the per-request
KV cache manager with fenced (deferred) frees.

Nothing here touches tensors: block ids are handed to the worker, which owns
the paged KV tensors.
"""

from tandem.kv.block import KVBlock
from tandem.kv.block_hash import hash_block_tokens
from tandem.kv.block_pool import BlockPool
from tandem.kv.free_block_queue import FreeBlockQueue
from tandem.kv.kv_cache_manager import KVCacheManager, KVRequest

__all__ = [
    "BlockPool",
    "FreeBlockQueue",
    "KVBlock",
    "KVCacheManager",
    "KVRequest",
    "hash_block_tokens",
]
