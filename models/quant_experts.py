"""Mixture-of-experts weights held quantized: one `QuantLinear` per expert and projection.

A transformers experts module stores its experts stacked, `gate_up_proj [E, 2 * I, H]` and
`down_proj [E, H, I]` (DiffusionGemma's `DiffusionGemmaTextExperts`). `QuantExperts` holds
expert e's `gate_up_proj[e]` and `down_proj[e]` each as a `QuantizedWeight` in the panel
layout (`quant_linear.QuantLinear`), quantized at load by `LinearQuantization.quantize`
(int8 or int4, groups of `quantization_group_size` inputs along H for gate/up and along I
for down). The router is not here: it stays float (its top-k picks the experts, and a
quantization step there would flip choices, not just perturb values).

`QuantExperts.run(rows, counts)` takes the routed token rows already grouped by expert
(rows `sum(counts[:e]) ..` belong to expert e) and returns each row's down projection:
one gate/up and one down kernel call per expert that has rows (a loop over experts, never
over tokens). The grouping, the routing weights and the scatter back to tokens are the
caller's (`diffusion_gemma_layers.moe_quantized`).

Contract: expert e's output equals `down(act(gate) * up)` with the dequantized weights
(`dense()`), up to float32 summation order (the kernel's weights are bit for bit
`QuantizedWeight.dequantize()`, see `quant_linear`). Activations are float32 in the
kernels; rows of another dtype (bfloat16 on the CPU) are widened and the result narrowed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.models.quant_linear import LinearQuantization, QuantLinear


class QuantExperts(torch.nn.Module):
    """`num_experts` experts' gate/up `[2 * I, H]` and down `[H, I]` projections as
    `QuantLinear`s (module docstring). `act_fn` is the experts' activation."""

    def __init__(
        self,
        gate_up: list[QuantLinear],
        down: list[QuantLinear],
        act_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(
                f"QuantExperts needs one gate/up and one down projection per expert, got "
                f"{len(gate_up)} and {len(down)}"
            )
        self.gate_up = gate_up
        self.down = down
        self.act_fn = act_fn
        self.num_experts = len(gate_up)
        self.hidden_dim = gate_up[0].in_features
        self.intermediate_dim = gate_up[0].out_features // 2

    @property
    def nbytes(self) -> int:
        """Bytes held for every expert's weights (codes, scales, mins)."""
        return sum(linear.nbytes for linear in (*self.gate_up, *self.down))

    def run(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`[P, H]` rows grouped by expert (`counts[e]` consecutive rows for expert e, in
        expert order, `sum(counts) == P`) -> `[P, H]` expert outputs, in `rows`' dtype."""
        if len(counts) != self.num_experts or sum(counts) != rows.shape[0]:
            raise ValueError(
                f"QuantExperts.run: counts must give {self.num_experts} experts' row counts "
                f"summing to {rows.shape[0]}, got {counts}"
            )
        x = rows if rows.dtype == torch.float32 else rows.float()
        out = torch.empty_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            block = x[start : start + n]
            gate, up = self.gate_up[expert](block).chunk(2, dim=-1)
            out[start : start + n] = self.down[expert](self.act_fn(gate) * up)
            start += n
        return out if rows.dtype == torch.float32 else out.to(rows.dtype)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized stacked weights, `gate_up_proj [E, 2 * I, H]` and `down_proj
        [E, H, I]` float32 (new memory; exact): what a float reference multiplies."""
        gate_up = torch.stack([linear.dense_weight() for linear in self.gate_up])
        down = torch.stack([linear.dense_weight() for linear in self.down])
        return gate_up, down


def quantize_experts(experts: torch.nn.Module, quant: LinearQuantization) -> QuantExperts:
    """`experts` (stacked `gate_up_proj [E, 2 * I, H]`, `down_proj [E, H, I]`, `act_fn`)
    quantized one expert at a time in `quant`'s format (`quant.at_load` must hold)."""
    if not quant.at_load:
        raise ValueError(f"quantize_experts needs quantization int8 or int4, got {quant.mode}")
    with torch.no_grad():
        gate_up = [QuantLinear(quant.quantize(w)) for w in experts.gate_up_proj.detach()]
        down = [QuantLinear(quant.quantize(w)) for w in experts.down_proj.detach()]
    return QuantExperts(gate_up, down, experts.act_fn)
