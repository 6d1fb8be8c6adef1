"""One DiffusionGemma transformer layer, run on tandem's flat token layout.

The weights are the transformers modules' own (`DiffusionGemmaEncoderTextLayer` /
`DiffusionGemmaDecoderTextLayer`: their norms, projections, dense MLP, router and experts
are called or read directly); only the data flow is tandem's: tokens are flattened
`[T, hidden]` and attention goes through a callback over the paged pools. The arithmetic
is transformers' (M:`DiffusionGemmaEncoderTextLayer.forward`):

    h   = x + post_attn_norm(attn(input_norm(x)))
    d   = post_ffw_norm_1(mlp(pre_ffw_norm(h)))                  dense branch
    m   = post_ffw_norm_2(experts(pre_ffw_norm_2(h), router(h)))  mixture of experts
    out = (h + post_ffw_norm(d + m)) * layer_scalar

Both branches run in every layer.

Under tensor parallelism (`diffusion_gemma_parallel`) the layer's weights are this rank's
part: `attention_block` all-reduces the row-parallel `o_proj` output, and `feed_forward`
all-reduces the dense and MoE partial sums together, as one `[T, 2 * hidden]` tensor,
before their norms (`reduce_branches`). Both are no-ops on one rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.core.worker.parallel_state import current, tp_all_reduce
from tandem.models.diffusion_gemma_attention import project_qkv
from tandem.models.quant_experts import QuantExperts

#: attention callback: (query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D]) -> [T, Hq, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def route(router: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing exactly as `DiffusionGemmaTextRouter.forward`: RMSNorm without scale,
    times `scale * hidden_size^-0.5`, linear to `num_experts`, softmax in float32, top-k,
    renormalised to sum 1, times `per_expert_scale[expert]`.

    Returns weights `[T, k]` (float32) and expert indices `[T, k]`."""
    normed = router.norm(hidden) * router.scale * router.scalar_root_size
    probs = F.softmax(router.proj(normed), dim=-1, dtype=torch.float32)
    weights, index = torch.topk(probs, k=router.config.top_k_experts, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * router.per_expert_scale[index], index


def moe_reference(
    experts: torch.nn.Module,
    hidden: torch.Tensor,
    weights: torch.Tensor,
    index: torch.Tensor,
    first_expert: int | None = None,
) -> torch.Tensor:
    """Mixture of experts, the reference loop (what transformers' eager path computes); the
    documented reference of `moe_grouped`, which the layers run.

    `experts.gate_up_proj` is `[E, 2 * I, H]`, `experts.down_proj` `[E, H, I]`. For each
    expert that some token picked: gather its tokens (`index_select`), `act(gate) * up`,
    down-project, scale by the routing weight, and `index_add_` back. A token picks an
    expert at most once, so the sum order within an expert is irrelevant and the result
    equals transformers' loop bit for bit on the same device and dtype.

    `first_expert`: None when `experts` holds every expert; else the global index of its
    first (expert parallelism): pairs routed to experts it does not hold are skipped, and
    the result is this rank's partial sum.

    On a GPU this would be fused rather than looped (one host sync per expert here):
    sort the `T * k` (token, expert) pairs by expert (`argsort` of `index.flatten()`, plus
    per-expert counts and offsets from a `bincount`), permute the token rows once, run one
    grouped GEMM for `gate_up_proj` over the E contiguous groups (e.g. `torch._grouped_mm`
    or a Triton/CUTLASS grouped kernel), the activation, one grouped GEMM for `down_proj`,
    then multiply by the routing weights and scatter-add back through the inverse
    permutation: two kernels for all experts, no host sync, CUDA-graph capturable. With
    few tokens per step (decode-sized canvases) a fused MoE kernel that reads only the hit
    experts' weights is the memory-bound optimum.
    """
    out = torch.zeros_like(hidden)
    first = first_expert or 0
    local = index - first
    for expert in torch.unique(local).tolist():
        if not 0 <= expert < experts.gate_up_proj.shape[0]:
            continue  # another rank's expert
        token, slot = torch.where(local == expert)
        rows = hidden.index_select(0, token)
        gate, up = F.linear(rows, experts.gate_up_proj[expert]).chunk(2, dim=-1)
        mixed = F.linear(experts.act_fn(gate) * up, experts.down_proj[expert])
        mixed = mixed * weights[token, slot, None]
        out.index_add_(0, token, mixed.to(out.dtype))
    return out


def _grouped_mm_fits(experts: torch.nn.Module) -> bool:
    """Whether `moe_grouped` runs `torch._grouped_mm` on these experts: CPU weights (the
    only device it is checked on here), the op exists in this torch build, and every row
    stride of the (transposed) weights is a multiple of 16 bytes (the op's requirement)."""
    gate_up = experts.gate_up_proj  # [E, 2 * I, H]
    size = gate_up.element_size()
    aligned = all(d * size % 16 == 0 for d in (gate_up.shape[1] // 2, gate_up.shape[2]))
    return gate_up.device.type == "cpu" and hasattr(torch, "_grouped_mm") and aligned


def _local_pairs(
    index: torch.Tensor, first_expert: int | None, num_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of `index [T, k]` whose expert this rank holds, as flat pair
    numbers `t * k + slot`, and their local expert index (global minus `first_expert`).
    With `first_expert` None every pair is local."""
    flat = index.reshape(-1)
    if first_expert is None:
        return torch.arange(flat.numel(), device=flat.device), flat
    local = flat - first_expert
    pair = ((local >= 0) & (local < num_local)).nonzero().squeeze(1)
    return pair, local.index_select(0, pair)


def _pairs_by_expert(
    index: torch.Tensor, first_expert: int | None, num_local: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This rank's (token, slot) pairs of `index [T, k]` sorted by local expert (stable:
    within an expert, in pair order), as flat pair numbers `t * k + slot`, and the pair
    count of each of the `num_local` experts (`[num_local]` int64). None: no local pair."""
    pair, local = _local_pairs(index, first_expert, num_local)
    if pair.numel() == 0:
        return None
    order = pair.index_select(0, torch.argsort(local, stable=True))
    return order, torch.bincount(local, minlength=num_local)


def moe_quantized(
    experts: QuantExperts,
    hidden: torch.Tensor,
    weights: torch.Tensor,
    index: torch.Tensor,
    first_expert: int | None = None,
) -> torch.Tensor:
    """`moe_reference`'s computation on experts held quantized: the pairs sorted by expert
    once, the token rows gathered once (`index_select`), one gate/up and one down kernel
    call per expert that has pairs (`QuantExperts.run`), then scaled by the routing
    weights and `index_add_`-ed back (each token's k experts in ascending-expert order, as
    `moe_grouped`). Equals `moe_reference` over the dequantized weights
    (`QuantExperts.dense`) up to float32 summation order inside the products.
    `first_expert`: as `moe_grouped`."""
    out = torch.zeros_like(hidden)
    grouped = _pairs_by_expert(index, first_expert, experts.num_experts)
    if grouped is None:  # no token picked this rank's experts
        return out
    order, counts = grouped
    token = order // index.shape[1]
    mixed = experts.run(hidden.index_select(0, token), counts.tolist())
    mixed = mixed * weights.reshape(-1).index_select(0, order)[:, None]
    return out.index_add_(0, token, mixed.to(out.dtype))


def moe_grouped(
    experts: torch.nn.Module,
    hidden: torch.Tensor,
    weights: torch.Tensor,
    index: torch.Tensor,
    first_expert: int | None = None,
) -> torch.Tensor:
    """`moe_reference`'s result with two grouped GEMMs and no per-expert host sync.

    The `T * k` (token, expert) pairs are sorted by expert once (stable `argsort`), the
    token rows permuted once, `gate_up_proj` and `down_proj` applied as one
    `torch._grouped_mm` each over the E contiguous groups (offsets: cumulative
    `bincount`), then scaled by the routing weights and `index_add_`-ed back. Each output
    row is the same dot products as the reference's per-expert `F.linear` and each token
    sums its k experts in the same ascending-expert order, so on this CPU build it equals
    `moe_reference` bit for bit (tests/diffusion/test_diffusion_gemma_forward.py checks it).
    Falls back to `moe_reference` where `_grouped_mm_fits` is False.

    `first_expert` (expert parallelism, `diffusion_gemma_parallel`): `experts` holds
    experts `first_expert ..` only; the pairs routed elsewhere are dropped before the sort
    and the result is this rank's partial sum (zero rows for tokens with no local pair).

    Experts held quantized (`quant_experts.QuantExperts`, `model.quantization` int8 /
    int4) go to `moe_quantized`."""
    if isinstance(experts, QuantExperts):
        return moe_quantized(experts, hidden, weights, index, first_expert)
    if not _grouped_mm_fits(experts):
        return moe_reference(experts, hidden, weights, index, first_expert)
    num_local = experts.gate_up_proj.shape[0]
    out = torch.zeros_like(hidden)
    grouped = _pairs_by_expert(index, first_expert, num_local)
    if grouped is None:  # no token picked this rank's experts
        return out
    order, counts = grouped
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)
    token = order // index.shape[1]
    rows = hidden.index_select(0, token)
    gate, up = torch._grouped_mm(rows, experts.gate_up_proj.transpose(1, 2), offs=offsets).chunk(
        2, dim=-1
    )
    mixed = torch._grouped_mm(
        experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2), offs=offsets
    )
    mixed = mixed * weights.reshape(-1).index_select(0, order)[:, None]
    return out.index_add_(0, token, mixed.to(out.dtype))


def reduce_branches(dense: torch.Tensor, moe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense and MoE partial sums `[T, hidden]` summed over the tensor-parallel ranks
    with one all-reduce of `[T, 2 * hidden]` (each branch has its own norm next, so they
    are summed apart, not together). The inputs themselves on one rank."""
    if current().tp_size == 1:
        return dense, moe
    both = tp_all_reduce(torch.cat([dense, moe], dim=-1))
    return both[:, : dense.shape[1]], both[:, dense.shape[1] :]


def feed_forward(
    layer: torch.nn.Module, hidden: torch.Tensor, first_expert: int | None = None
) -> torch.Tensor:
    """Dense MLP plus MoE branch and the residual, `[T, hidden]` -> `[T, hidden]`.
    `first_expert`: see `moe_grouped` (None: this layer holds every expert)."""
    dense = layer.mlp(layer.pre_feedforward_layernorm(hidden))
    weights, index = route(layer.router, hidden)
    moe = moe_grouped(
        layer.experts, layer.pre_feedforward_layernorm_2(hidden), weights, index, first_expert
    )
    dense, moe = reduce_branches(dense, moe)
    dense = layer.post_feedforward_layernorm_1(dense)
    moe = layer.post_feedforward_layernorm_2(moe)
    out = hidden + layer.post_feedforward_layernorm(dense + moe)
    return out * layer.layer_scalar


def attention_block(
    layer: torch.nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: Attend,
) -> torch.Tensor:
    """`x + post_attn_norm(o_proj(attend(q, k, v)))` for `[T, hidden]` tokens; `o_proj`'s
    output is summed over the tensor-parallel ranks (row-parallel) before the norm."""
    query, key, value = project_qkv(layer.self_attn, layer.input_layernorm(hidden), cos, sin)
    attended = attend(query, key, value)
    out = tp_all_reduce(layer.self_attn.o_proj(attended.reshape(hidden.shape[0], -1)))
    return hidden + layer.post_attention_layernorm(out)


def layer_forward(
    layer: torch.nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: Attend,
    first_expert: int | None = None,
) -> torch.Tensor:
    """The whole layer (attention, then dense + MoE feed-forward)."""
    return feed_forward(layer, attention_block(layer, hidden, cos, sin, attend), first_expert)
