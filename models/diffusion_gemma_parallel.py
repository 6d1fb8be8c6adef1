"""How DiffusionGemma splits across tensor-parallel ranks (`parallel.tensor_parallel_size`).

Every rank loads the whole checkpoint, then `shard_layers` replaces the weights of each
encoder/decoder layer with this rank's part (the two passes share their weight tensors, so
a tensor is cut once and both passes get the same cut tensor):

- attention, column-parallel by heads: `q_proj` rows of query heads `r*Hq/tp ..`, `k_proj`
  and (sliding layers) `v_proj` rows of this rank's KV heads, in both layer groups with
  their own KV heads and head_dim (sliding: `num_key_value_heads` x `head_dim`; full:
  the per-layer `num_key_value_heads` x `head_dim`, i.e. the global ones). Fewer KV heads
  than ranks: each KV head is replicated on `tp / Hkv` consecutive ranks
  (`tensor_parallel.kv_split`). The norms over head_dim (`q_norm`, `k_norm`, `v_norm`)
  are replicated. `o_proj` is row-parallel: its columns of this rank's heads, then one
  all-reduce of `[T, hidden]` before `post_attention_layernorm`.
- dense MLP: `gate_proj`/`up_proj` rows `r*I/tp ..` (column), `down_proj` the same
  columns (row-parallel, partial `[T, hidden]`).
- mixture of experts, expert-parallel: rank r keeps experts `r*E/tp .. (r+1)*E/tp - 1`
  whole (`gate_up_proj`, `down_proj`); the router is replicated, so every rank routes every
  token identically and computes only the (token, expert) pairs whose expert it holds
  (`diffusion_gemma_layers.moe_grouped` with `first_expert`); the other ranks add the
  rest. The dense branch and the MoE branch each pass through their own RMSNorm
  (`post_feedforward_layernorm_1` / `_2`) before they are added, so their partial sums
  cannot be summed together; they are concatenated and reduced by ONE all-reduce of
  `[T, 2 * hidden]` (two sums, one collective).

So a layer costs two all-reduces: `[T, hidden]` after attention and `[T, 2 * hidden]`
after the feed-forward (the encoder's last layer only writes K/V: none). Everything else is
replicated: the embedding (one table used three ways: the encoder's and the decoder's
lookups, the decoder's self-conditioning soft embedding `softmax(logits) @ E` over the
whole vocabulary, and the tied LM head), the self-conditioning MLP, the norms, the router,
the final norm, the LM head and the (unused) vision tower. A vocab-parallel head would
save `V x hidden` per rank at the cost of an all-gather of the logits and one more
all-reduce for the soft embedding; the tiny and served vocabularies fit replicated, so it
is left for when a model needs it.

Why experts are split, not replicated: at real sizes the experts hold most of a layer's
weights (`E x 3 x I_moe x hidden`, against about `2 x (Hq + Hkv) x D x hidden` for
attention and `3 x I x hidden` for the dense MLP), so replicating them would leave each
rank holding most of the model and computing every pair; split, each rank holds `1/tp` of
them and computes only its pairs (`T * k / tp` on average), and their partial sums travel
in the dense branch's collective (one call, twice the bytes) instead of a call of their
own. The price: with skewed routing one rank gets more pairs than the others and the step
waits for it (no capacity limit or rebalancing here), and what a rank computes depends on
the routing (never the collectives it calls: those are the same on every rank).

Exactness against one rank (float32): the MoE partials are exact for `tp = 2` and
`top_k = 2` (each token's two contributions are added in the same order, and `x + 0` is
`x`); the row-parallel `o_proj` and `down_proj` sums are not bit-exact (a K-split GEMM
rounds differently), of the order of float32 rounding. Every rank gets the same bits from
the all-reduce, so ranks never disagree with each other; the tests compare tokens.

Sizes: `num_attention_heads`, `intermediate_size` and `num_experts` must divide by
`tensor_parallel_size`; each layer's KV heads must divide it or be divided by it; else a
`ConfigError` naming both keys (`check_divisible`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.core.worker.parallel_state import RankInfo
from tandem.models.tensor_parallel import kv_split, shard_cols, shard_rows
from tandem.schema.config import ConfigError

_KEY = "parallel.tensor_parallel_size"


class LayerHeads:
    """One DiffusionGemma layer's head counts, as the attributes `tensor_parallel`'s
    `kv_split` and `kv_heads_per_rank` read (its KV heads are the per-layer ones: the
    sliding or the global count)."""

    def __init__(self, text_config: Any, layer: int) -> None:
        self.num_attention_heads = int(text_config.num_attention_heads)
        self.num_key_value_heads = int(text_config.per_layer_config[layer].num_key_value_heads)


def _kv_key(text_config: Any, layer: int) -> str:
    """The config key that sets layer `layer`'s KV heads (a per-layer override, or the
    model-wide `num_key_value_heads`)."""
    heads = text_config.per_layer_config[layer].num_key_value_heads
    # the config forbids reading a per-layer attribute's global value directly
    if heads == text_config.to_dict().get("num_key_value_heads"):
        return "text_config.num_key_value_heads"
    return f"text_config.per_layer_config.{layer}.num_key_value_heads"


def check_divisible(text_config: Any, tp: int) -> None:
    """ConfigError naming `parallel.tensor_parallel_size` and the model key when a
    `DiffusionGemmaTextConfig` does not split evenly over `tp` ranks (module docstring)."""
    if tp == 1:
        return
    for name in ("num_attention_heads", "intermediate_size", "num_experts"):
        size = int(getattr(text_config, name))
        if size % tp:
            raise ConfigError(
                f"{_KEY}: {tp} does not divide the model's text_config.{name} ({size}); "
                f"choose a size that divides {name}"
            )
    for layer in range(text_config.num_hidden_layers):
        heads = int(text_config.per_layer_config[layer].num_key_value_heads)
        if heads % tp and tp % heads:
            raise ConfigError(
                f"{_KEY}: {tp} neither divides the model's {_kv_key(text_config, layer)} "
                f"({heads}, layer {layer}) nor is a multiple of it (KV heads are split, or "
                "replicated when fewer than the ranks)"
            )


def first_expert(text_config: Any, rank: RankInfo) -> int | None:
    """The global index of this rank's first expert; None on one rank (all experts here)."""
    if rank.tp_size == 1:
        return None
    return rank.tp_rank * (int(text_config.num_experts) // rank.tp_size)


class _Cutter:
    """Cuts each weight tensor once: tied tensors (the encoder's and the decoder's layers
    hold the same ones) get the same cut parameter."""

    def __init__(self) -> None:
        self._done: dict[int, tuple[torch.Tensor, torch.nn.Parameter]] = {}

    def __call__(
        self, weight: torch.Tensor, cut: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.nn.Parameter:
        hit = self._done.get(id(weight))
        if hit is None:  # the original is kept in the entry: its id cannot be reused meanwhile
            hit = (weight, torch.nn.Parameter(cut(weight.detach()), requires_grad=False))
            self._done[id(weight)] = hit
        return hit[1]


def _columns(linear: torch.nn.Module, cutter: _Cutter, part: int, parts: int) -> None:
    """Column-parallel: keep output rows (and bias) `part` of `parts`."""
    linear.weight = cutter(linear.weight, lambda w: shard_rows(w, part, parts))
    if linear.bias is not None:
        linear.bias = cutter(linear.bias, lambda b: shard_rows(b, part, parts))


def _rows(linear: torch.nn.Module, cutter: _Cutter, rank: RankInfo) -> None:
    """Row-parallel: keep input columns `tp_rank` of `tp_size`; the bias is added once, on
    rank 0 (the others' is zero), because the outputs are summed over the ranks."""
    linear.weight = cutter(linear.weight, lambda w: shard_cols(w, rank.tp_rank, rank.tp_size))
    if linear.bias is not None:
        keep = rank.tp_rank == 0
        linear.bias = cutter(linear.bias, lambda b: b.clone() if keep else torch.zeros_like(b))


def _shard_layer(
    layer: torch.nn.Module, layer_config: Any, cutter: _Cutter, rank: RankInfo
) -> None:
    """One transformers layer (encoder or decoder) cut to this rank (module docstring)."""
    tp, r = rank.tp_size, rank.tp_rank
    attn = layer.self_attn
    _columns(attn.q_proj, cutter, r, tp)
    kv_part, kv_parts = kv_split(layer_config, r, tp)
    _columns(attn.k_proj, cutter, kv_part, kv_parts)
    if attn.v_proj is not None:
        _columns(attn.v_proj, cutter, kv_part, kv_parts)
    _rows(attn.o_proj, cutter, rank)
    _columns(layer.mlp.gate_proj, cutter, r, tp)
    _columns(layer.mlp.up_proj, cutter, r, tp)
    _rows(layer.mlp.down_proj, cutter, rank)
    experts = layer.experts
    experts.gate_up_proj = cutter(experts.gate_up_proj, lambda w: shard_rows(w, r, tp))
    experts.down_proj = cutter(experts.down_proj, lambda w: shard_rows(w, r, tp))


def shard_layers(text_config: Any, layer_lists: list[torch.nn.ModuleList], rank: RankInfo) -> None:
    """Cut every layer of each list in `layer_lists` (the encoder's, the decoder's) to
    `rank`'s part, in place. Call once, after loading, with `check_divisible` passed."""
    if rank.tp_size == 1:
        return
    cutter = _Cutter()
    with torch.no_grad():
        for layers in layer_lists:
            for i, layer in enumerate(layers):
                _shard_layer(layer, LayerHeads(text_config, i), cutter, rank)
