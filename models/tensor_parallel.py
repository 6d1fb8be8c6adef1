"""How a Llama-family layer splits across tensor-parallel ranks (Megatron's scheme).

Column-parallel (outputs split, no communication): the Q, K and V projections by heads (rank
r holds query heads `r*Hq/tp ..` and KV heads `r*Hkv/tp ..`), gate and up by intermediate
columns. Row-parallel (inputs split, one all-reduce of the `[T, hidden]` output each): the O
projection over this rank's heads and the down projection over its intermediate columns;
their biases are added once, on tensor-parallel rank 0. The LM head is split by vocabulary
rows into equal shards of `ceil(V / tp)` (the last one padded with zero rows) and the
logits are all-gathered; the embedding is replicated.

Rule for sizes: the query heads, the KV heads and the intermediate size must each divide by
`tensor_parallel_size` (`check_divisible`, an error naming the key); the vocabulary need not.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tandem.schema.config import ConfigError


def check_divisible(hf_config: Any, tp: int) -> None:
    """ConfigError naming `parallel.tensor_parallel_size` when a split would be uneven."""
    if tp == 1:
        return
    sizes = {
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": getattr(
            hf_config, "num_key_value_heads", hf_config.num_attention_heads
        ),
        "intermediate_size": hf_config.intermediate_size,
    }
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(
                f"parallel.tensor_parallel_size: {tp} does not divide the model's {name} "
                f"({size}); choose a size that divides {name}"
            )


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
