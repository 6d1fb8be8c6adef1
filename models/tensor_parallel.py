"""How a Llama-family layer splits across tensor-parallel ranks (Megatron's scheme).

Column-parallel (outputs split, no communication): the Q, K and V projections by heads (rank
r holds query heads `r*Hq/tp ..` and KV heads `r*Hkv/tp ..`), gate and up by intermediate
columns. Row-parallel (inputs split, one all-reduce of the `[T, hidden]` output each): the O
projection over this rank's heads and the down projection over its intermediate columns;
their biases are added once, on tensor-parallel rank 0. The embedding and the LM head are
split by vocabulary rows into equal shards of `ceil(V / tp)` (the last one padded with zero
rows): a rank looks up only the ids in its shard (zeros for the others) and the rows are
summed over the ranks (`VocabParallelEmbedding`: exactly one rank contributes each row, so
the sum is the row itself, bit for bit); the logits are all-gathered.

Rule for sizes: the query heads and the intermediate size must divide by
`tensor_parallel_size`; the KV heads must either divide by it or divide it. With fewer KV
heads than ranks, each KV head is replicated on `tp / num_key_value_heads` consecutive ranks
(rank r keeps KV head `r // (tp / Hkv)`, which is the head all of its query heads read, as
in vLLM). Anything else is an error naming the key (`check_divisible`). The vocabulary need
not divide.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from tandem.core.worker.parallel_state import tp_all_reduce
from tandem.schema.config import ConfigError


def check_divisible(hf_config: Any, tp: int) -> None:
    """ConfigError naming `parallel.tensor_parallel_size` when a split would be uneven."""
    if tp == 1:
        return
    kv_heads = _kv_heads(hf_config)
    sizes = {
        "num_attention_heads": hf_config.num_attention_heads,
        "intermediate_size": hf_config.intermediate_size,
    }
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(
                f"parallel.tensor_parallel_size: {tp} does not divide the model's {name} "
                f"({size}); choose a size that divides {name}"
            )
    if kv_heads % tp and tp % kv_heads:
        raise ConfigError(
            f"parallel.tensor_parallel_size: {tp} neither divides the model's "
            f"num_key_value_heads ({kv_heads}) nor is a multiple of it (KV heads are split, "
            "or replicated when fewer than the ranks)"
        )


def _kv_heads(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def kv_heads_per_rank(hf_config: Any, tp: int) -> int:
    """KV heads each rank holds: `Hkv / tp`, or 1 when they are replicated (Hkv < tp)."""
    return max(1, _kv_heads(hf_config) // tp)


def kv_split(hf_config: Any, rank: int, tp: int) -> tuple[int, int]:
    """`(part, parts)`: which of `parts` equal row blocks of K and V this rank keeps (its
    own block, or the one KV head its group of replicas shares)."""
    kv_heads = _kv_heads(hf_config)
    if kv_heads >= tp:
        return rank, tp
    return rank // (tp // kv_heads), kv_heads


def shard_rows(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rows `rank*n/size .. (rank+1)*n/size` of a weight (or a bias), as a new tensor."""
    n = weight.shape[0] // size
    return weight[rank * n : (rank + 1) * n].clone()


def shard_cols(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Columns `rank*n/size ..` of a `[out, in]` weight, as a new contiguous tensor."""
    n = weight.shape[1] // size
    return weight[:, rank * n : (rank + 1) * n].contiguous()


def vocab_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's `ceil(V / size)` rows of an LM-head weight `[V, hidden]`, zero-padded
    past the vocabulary (those logits are sliced off after the gather)."""
    per = math.ceil(weight.shape[0] / size)
    part = weight[rank * per : (rank + 1) * per]
    shard = torch.zeros((per, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    shard[: part.shape[0]] = part
    return shard


class VocabParallelEmbedding:
    """This rank's `ceil(V / tp)` rows of the embedding table; a lookup gives every rank the
    full `[T, hidden]` rows (in `dtype`) after one all-reduce."""

    def __init__(self, weight: torch.Tensor, rank: int, size: int, dtype: torch.dtype) -> None:
        with torch.no_grad():
            self.shard = vocab_shard(weight, rank, size)
        self.start = rank * self.shard.shape[0]
        self.dtype = dtype

    @classmethod
    def from_rows(cls, rows: torch.Tensor, rank: int, dtype: torch.dtype) -> VocabParallelEmbedding:
        """Over this rank's `ceil(V / tp)` rows as already read (`vocab_shard`'s layout:
        zero-padded past V), kept as they are (no copy)."""
        embedding = cls.__new__(cls)
        embedding.shard, embedding.start, embedding.dtype = rows, rank * rows.shape[0], dtype
        return embedding

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.shard.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.shard).to(self.dtype)
        rows.masked_fill_(outside[:, None], 0.0)
        return tp_all_reduce(rows)
