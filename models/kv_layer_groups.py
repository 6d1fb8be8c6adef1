"""Paged KV pools per layer group: one block table, several KV shapes.

A model whose layers do not all store the same K/V shape (DiffusionGemma: sliding-window
layers with `head_dim` and `num_key_value_heads`, full-attention layers with
`global_head_dim` and `num_global_key_value_heads`) cannot use one `[blocks, block_size,
heads, dim]` shape for every layer. A `KVLayerGroup` is a set of layers with the same
shape; each group gets its own pools, and **every group is indexed by the same block ids**:
block `b` of a request holds its tokens `[i * block_size, (i + 1) * block_size)` in every
group at once, so the scheduler's `KVCacheManager` (one block pool, one block table per
request, one slot mapping per step) is unchanged. A block's size in bytes is the sum over
groups (`bytes_per_block`), which is what a memory budget divides.

An autoregressive model is one group (`single_group`); its per-layer `(key, value)` list
(`KVPools.per_layer`) is exactly what `paged_attention.PagedAttentionMetadata.kv_caches`
takes, so that path needs nothing new.

`shares_kv`: the group stores one tensor per layer and reads it as both key and value
(models whose value *is* the key, e.g. MLA-style latents). DiffusionGemma's full layers
share the K/V *projection* but not the cached tensors (K = rope(k_norm(p)), V = v_norm(p)),
so they are not `shares_kv`.

`sliding_window` W is recorded for the attention (a layer sees keys `kv > q - W`); the pools
still hold every token, so blocks behind the window are not reclaimed early (a memory
saving left for later: it needs a per-group block table).

Pools are allocated, not filled (`torch.empty`): attention must read only slots that were
written, or mask and zero the rest (see `paged_attention`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayerGroup:
    """Layers with one KV shape. `layer_indices` are the model's layer numbers, ascending."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    shares_kv: bool = False
    sliding_window: int | None = None
    layer_indices: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_indices and len(self.layer_indices) != self.num_layers:
            raise ValueError("layer_indices must list num_layers layers")
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"a KV layer group needs positive sizes, got {self}")

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV bytes one token takes in all of this group's layers."""
        tensors = 1 if self.shares_kv else 2
        elem = torch.empty((), dtype=dtype).element_size()
        return tensors * self.num_layers * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True, slots=True)
class LayerKVShape:
    """One layer's KV shape, the input of `group_layers`."""

    num_kv_heads: int
    head_dim: int
    shares_kv: bool = False
    sliding_window: int | None = None


def group_layers(layers: Sequence[LayerKVShape]) -> list[KVLayerGroup]:
    """Group layers by identical shape, groups in order of their first layer."""
    members: dict[LayerKVShape, list[int]] = {}
    for index, shape in enumerate(layers):
        members.setdefault(shape, []).append(index)
    return [
        KVLayerGroup(
            num_layers=len(indices),
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            shares_kv=shape.shares_kv,
            sliding_window=shape.sliding_window,
            layer_indices=tuple(indices),
        )
        for shape, indices in members.items()
    ]


def single_group(num_layers: int, num_kv_heads: int, head_dim: int) -> list[KVLayerGroup]:
    """The one group of a model whose layers all share a KV shape."""
    return group_layers([LayerKVShape(num_kv_heads, head_dim)] * num_layers)


def bytes_per_block(groups: Sequence[KVLayerGroup], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs across every group (what a KV memory budget divides)."""
    return block_size * sum(group.bytes_per_token(dtype) for group in groups)


class KVPools:
    """The pools of every group, addressed by model layer.

    Per layer: key and value pools `[num_blocks, block_size, num_kv_heads, head_dim]` of its
    group (the same tensor twice when the group `shares_kv`). Token t of a step goes to flat
    slot `slot_mapping[t] = block_id * block_size + offset` in every layer.
    """

    def __init__(
        self,
        groups: Sequence[KVLayerGroup],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.groups = list(groups)
        self.num_blocks = num_blocks
        self.block_size = block_size
        layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._group_of: dict[int, KVLayerGroup] = {}
        for group in self.groups:
            shape = (num_blocks, block_size, group.num_kv_heads, group.head_dim)
            for layer in group.layer_indices:
                if layer in layers:
                    raise ValueError(f"layer {layer} is in two KV layer groups")
                key = torch.empty(shape, dtype=dtype, device=device)
                value = key if group.shares_kv else torch.empty(shape, dtype=dtype, device=device)
                layers[layer] = (key, value)
                self._group_of[layer] = group
        if sorted(layers) != list(range(len(layers))):
            raise ValueError(f"KV layer groups must cover layers 0..n-1, got {sorted(layers)}")
        self.per_layer: list[tuple[torch.Tensor, torch.Tensor]] = [
            layers[i] for i in range(len(layers))
        ]

    @property
    def num_layers(self) -> int:
        return len(self.per_layer)

    def group_of(self, layer: int) -> KVLayerGroup:
        return self._group_of[layer]

    def write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store `[T, num_kv_heads, head_dim]` keys and values at `slot_mapping` `[T]`.
        With `shares_kv` only `key` is stored (`value` must be the same tensor)."""
        k_pool, v_pool = self.per_layer[layer]
        k_pool.view(-1, *key.shape[1:]).index_copy_(0, slot_mapping, key.to(k_pool.dtype))
        if v_pool is not k_pool:
            v_pool.view(-1, *value.shape[1:]).index_copy_(0, slot_mapping, value.to(v_pool.dtype))

    def nbytes(self) -> int:
        """Bytes allocated (a shared key/value tensor counted once)."""
        seen: dict[int, int] = {}
        for k, v in self.per_layer:
            for t in (k, v):
                seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())
