"""DiffusionGemma's weights quantized at load (`model.quantization: int8 | int4`, CPU only).

`quantize_model` replaces, in place, in every encoder and decoder text layer:

- each `nn.Linear` (attention `q_proj`, `k_proj`, `v_proj`, `o_proj`; the dense MLP's
  `gate_proj`, `up_proj`, `down_proj`) by a `QuantModule` over a `QuantLinear`;
- the stacked experts (`gate_up_proj [E, 2 * I, H]`, `down_proj [E, H, I]`) by a
  `quant_experts.QuantExperts` (one quantized weight per expert and projection),

and the decoder's self-conditioning MLP (`gate_proj`, `up_proj`, `down_proj`) likewise,
all in `LinearQuantization.quantize`'s format (int8 or int4 in groups of
`quantization_group_size` inputs). An LM head not tied to the embedding is quantized as
the autoregressive path's is (int8 in both modes, `LinearQuantization.quantize_head`).

Kept float: the router (`router.proj`, its scales: the top-k choice), the norms and
`layer_scalar`s, the embedding table and the LM head tied to it (DiffusionGemma ties them:
the table is also read whole by the self-conditioning soft embedding `softmax(logits) @ E`,
so a quantized head would be a second copy next to the float table), and the vision tower
(loaded, never run: tandem serves text).

The encoder and decoder layers share their weight tensors (transformers ties them): each
tensor is quantized once and both passes call the same `QuantLinear` / `QuantExperts`.
The float parameters replaced are released (meta tensors, `weight_release`) as each module
is replaced; the float model is whole in memory before this runs (transformers loads it),
so the load-time peak is the float model plus one layer's codes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from tandem.models.quant_experts import QuantExperts, quantize_experts
from tandem.models.quant_linear import LinearQuantization, QuantLinear
from tandem.models.weight_release import release_parameters


class QuantModule(torch.nn.Module):
    """An `nn.Linear` stand-in over a `QuantLinear`: `[..., in]` -> `[..., out]` in the
    input's dtype (the kernel multiplies in float32; other dtypes are widened, then
    narrowed). Holds no float weight."""

    def __init__(self, linear: QuantLinear) -> None:
        super().__init__()
        self.linear = linear
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = self.linear(flat if flat.dtype == torch.float32 else flat.float())
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


@dataclass
class _Quantizer:
    """Quantizes each float tensor once (tied tensors: one shared result); each entry keeps
    the original tensor, so its id cannot be reused while the walk runs."""

    quant: LinearQuantization
    done: dict[int, tuple[torch.Tensor, torch.nn.Module]] = field(default_factory=dict)

    def linear(self, module: torch.nn.Linear, head: bool = False) -> QuantModule:
        hit = self.done.get(id(module.weight))
        if hit is None:
            quantize = self.quant.quantize_head if head else self.quant.quantize
            with torch.no_grad():
                layer = QuantLinear(quantize(module.weight.detach()), module.bias)
            hit = (module.weight, QuantModule(layer))
            self.done[id(module.weight)] = hit
        assert isinstance(hit[1], QuantModule)
        return hit[1]

    def experts(self, module: torch.nn.Module) -> QuantExperts:
        hit = self.done.get(id(module.gate_up_proj))
        if hit is None:
            hit = (module.gate_up_proj, quantize_experts(module, self.quant))
            self.done[id(module.gate_up_proj)] = hit
        assert isinstance(hit[1], QuantExperts)
        return hit[1]


def _replace_linears(root: torch.nn.Module, quantizer: _Quantizer, skip: str) -> None:
    """Every `nn.Linear` under `root` (none under a child named `skip`) by its
    `QuantModule`; the replaced module's float parameters are released."""
    for name, module in list(root.named_modules()):
        if not isinstance(module, torch.nn.Linear) or name.split(".")[0] == skip:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, attr, quantizer.linear(module))
        release_parameters([module])


def quantize_model(
    hf: torch.nn.Module, layer_lists: Iterable[torch.nn.ModuleList], quant: LinearQuantization
) -> None:
    """Quantize `hf` (a `DiffusionGemmaForBlockDiffusion`) in place (module docstring):
    the layers of each list in `layer_lists` (the encoder's and the decoder's; under tensor
    parallelism already cut to this rank), the decoder's self-conditioning MLP and an
    untied LM head. `quant.at_load` must hold (ValueError naming the mode otherwise)."""
    if not quant.at_load:
        raise ValueError(f"quantize_model needs quantization int8 or int4, got {quant.mode}")
    quantizer = _Quantizer(quant)
    for layers in layer_lists:
        for layer in layers:
            _replace_linears(layer, quantizer, skip="router")
            experts = layer.experts
            layer.experts = quantizer.experts(experts)
            release_parameters([experts])
    _replace_linears(hf.model.decoder.self_conditioning, quantizer, skip="")
    head = hf.lm_head
    if head.weight is not hf.model.decoder.embed_tokens.weight:  # untied: its own weight
        hf.lm_head = quantizer.linear(head, head=True)
        release_parameters([head])


def held_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """Bytes the weights of `modules` hold, each tensor counted once: float parameters and
    buffers not on the meta device, and the codes, scales and mins of every `QuantModule`
    and `QuantExperts` under them."""
    seen: set[int] = set()
    total = 0
    for root in modules:
        for module in root.modules():
            if isinstance(module, (QuantModule, QuantExperts)) and id(module) not in seen:
                seen.add(id(module))
                total += module.linear.nbytes if isinstance(module, QuantModule) else module.nbytes
        for tensor in [*root.parameters(), *root.buffers()]:
            if tensor.device.type != "meta" and id(tensor) not in seen:
                seen.add(id(tensor))
                total += tensor.numel() * tensor.element_size()
    return total
