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

Quantized weights split the same way: rows of codes, scales and mins for column-parallel
layers; whole groups of input columns for row-parallel ones, so every rank holds exactly
its part of the one-rank weight. A split that would cut a group is refused naming the layer
and the group size (`check_quantized_split` for weights quantized at load, `GGUFShards.cols`
for a GGUF's kept blocks).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tandem.core.worker.parallel_state import tp_all_reduce
from tandem.schema.config import ConfigError

if TYPE_CHECKING:
    from tandem.models.quant_linear import LinearQuantization


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


def check_quantized_split(hf_config: Any, tp: int, quant: LinearQuantization | None) -> None:
    """ConfigError naming `model.quantization_group_size` and the layer when weights
    quantized at load (`int8` / `int4`) would not split on whole groups: a row-parallel
    layer (O over `heads * head_dim` inputs, down over `intermediate_size`) gives each rank
    `inputs / tp` of them, which its groups must divide, so the ranks hold exactly one
    rank's codes and scales, cut (per output channel, `0`, is one group of all inputs: any
    split cuts it)."""
    if tp == 1 or quant is None or not quant.at_load:
        return
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    inputs = {
        "self_attn.o_proj": hf_config.num_attention_heads * head_dim,
        "mlp.down_proj": hf_config.intermediate_size,
    }
    group = quant.group_size
    for layer, size in inputs.items():
        share = size // tp
        if group == 0 or share % group:
            what = "one scale per output channel (0)" if group == 0 else f"groups of {group}"
            raise ConfigError(
                f"model.quantization_group_size: {quant.mode} in {what} cannot split {layer} "
                f"({size} inputs) over tensor_parallel_size {tp} ({share} inputs a rank) on "
                "whole groups; choose a group size that divides "
                f"{share}, or another tensor_parallel_size"
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
