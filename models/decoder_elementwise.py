"""The element-wise steps of `FusedDecoder`: RMS norms, the residual add, RoPE, SiLU * up.

Two implementations of one contract, chosen once per decoder:

- `FusedElementwise`: the compiled CPU kernels (`fused_ops`), float32 CPU activations;
  one pass over the data per step instead of a chain of torch ops (measured share of a
  batch-64 decode step before: 12 %, `python benchmarks/step_costs.py`).
- `TorchElementwise`: the same math as torch ops (CUDA, other dtypes, no compiler).

Both follow the transformers modules' arithmetic (Llama RMSNorm, rotate-half RoPE with the
rotary module's own cos/sin, `silu(gate) * up`) to float rounding. RoPE rotates the query
and key heads in place inside the fused QKV projection's output, so the attention reads
views of it. The cos/sin rows come from `RotaryTable`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from tandem.models.fused_ops import FusedOps, fused_ops

#: Rotary types whose cos/sin at a position depend on the sequence (transformers'
#: `dynamic_rope_update`): computed per step, never tabled.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


class RotaryTable:
    """cos/sin rows of the model's rotary module, `[num_positions, head_dim]` float32.

    Static rotary types are tabled for positions `0..n` (grown by doubling on demand), and
    the rows at `positions` are exactly what the module returns for them: each row depends
    only on its own position. Dynamic types compute the step's rows (`rows_for`)."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        self.rotary = rotary
        self.dynamic = getattr(rotary, "rope_type", "default") in DYNAMIC_ROPE_TYPES
        self.cos = self.sin = torch.empty(0)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(1, dtype=torch.float32, device=positions.device)
        cos, sin = self.rotary(probe, positions[None])
        return cos[0].float().contiguous(), sin[0].float().contiguous()

    def rows_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(cos, sin, index)`: the rows of token `i` are `cos[index[i]]`, `sin[index[i]]`."""
        if self.dynamic:
            cos, sin = self._compute(positions)
            return cos, sin, torch.arange(positions.numel(), device=positions.device)
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self.cos.shape[0] or self.cos.device != positions.device:
            size = max(needed, 2 * self.cos.shape[0], 256)
            self.cos, self.sin = self._compute(torch.arange(size, device=positions.device))
        return self.cos, self.sin, positions


class Elementwise(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm_(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """`h += delta` in place; returns the RMS norm of the new `h`."""
        ...

    def rope_(
        self,
        qkv: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        q_heads: int,
        kv_heads: int,
    ) -> None:
        """Rotate the leading `q_heads + kv_heads` heads of each `qkv` row in place."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class TorchElementwise:
    """The element-wise steps as torch ops (any device, any dtype)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + eps))

    def add_rms_norm_(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.rms_norm(h.add_(delta), weight, eps)

    def rope_(
        self,
        qkv: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        q_heads: int,
        kv_heads: int,
    ) -> None:
        cos, sin, index = table
        head_dim = cos.shape[1]
        width = (q_heads + kv_heads) * head_dim
        x = qkv[:, :width].view(qkv.shape[0], q_heads + kv_heads, head_dim)
        c, s = cos[index][:, None, :].to(x.dtype), sin[index][:, None, :].to(x.dtype)
        half = head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        qkv[:, :width] = (x * c + rotated * s).reshape(qkv.shape[0], width)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        half = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :half]) * gate_up[:, half:]


class FusedElementwise:
    """The element-wise steps on the compiled CPU kernels (float32 CPU tensors).

    The decoder's hot path: it calls the C functions without `FusedOps`' argument checks
    (about 3 us each, a millisecond per token at batch 1), on arguments that hold them by
    construction: `pick_elementwise` chose this for float32 CPU activations, every tensor
    passed is made contiguous here (a no-op for the decoder's own), the QKV rows are the
    projection's output and the rotary rows come from `RotaryTable`, which covers every
    position it is asked for.
    """

    def __init__(self, ops: FusedOps) -> None:
        self.ops = ops
        self.lib = ops.library

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.tandem_rms_norm_f32(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm_(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        delta = delta.contiguous()
        out = torch.empty_like(h)
        self.lib.tandem_add_rms_norm_f32(
            h.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(), h.shape[0],
            h.shape[1], eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rope_(
        self,
        qkv: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        q_heads: int,
        kv_heads: int,
    ) -> None:
        cos, sin, index = table
        self.lib.tandem_rope_f32(
            qkv.data_ptr(), index.contiguous().data_ptr(), cos.data_ptr(), sin.data_ptr(),
            qkv.shape[0], qkv.shape[1], q_heads, kv_heads, cos.shape[1], torch.get_num_threads(),
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = gate_up.new_empty((rows, width // 2))
        self.lib.tandem_silu_mul_f32(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        return out

    # bfloat16 operands of bf16 linears (`FusedDecoder`'s bf16 path; `fused_ops` states
    # their exactness): h and the norm weights stay float32.
    def rms_norm_bf16(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        self.lib.tandem_rms_norm_bf16(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm_bf16_(
        self,
        h: torch.Tensor,
        delta: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """`h += delta` (bfloat16) in place; the norm of the new `h` in `out_dtype`."""
        delta = delta.contiguous()
        out = torch.empty(h.shape, dtype=out_dtype)
        self.lib.tandem_add_rms_norm_bf16(
            h.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
            int(out_dtype == torch.bfloat16), h.shape[0], h.shape[1], eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rope_bf16(
        self,
        qkv: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        q_heads: int,
        kv_heads: int,
    ) -> torch.Tensor:
        """`qkv.float()` (bfloat16 in) with `rope_` applied, in one pass."""
        qkv = qkv.contiguous()
        cos, sin, index = table
        out = torch.empty(qkv.shape, dtype=torch.float32)
        self.lib.tandem_rope_bf16(
            qkv.data_ptr(), out.data_ptr(), index.contiguous().data_ptr(), cos.data_ptr(),
            sin.data_ptr(), qkv.shape[0], qkv.shape[1], q_heads, kv_heads, cos.shape[1],
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_mul_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        rows, width = gate_up.shape
        out = gate_up.new_empty((rows, width // 2))
        self.lib.tandem_silu_mul_bf16(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        return out


def pick_elementwise(device: torch.device, dtype: torch.dtype) -> Elementwise:
    """The compiled kernels for float32 activations on CPU when they load, else torch."""
    ops = fused_ops() if device.type == "cpu" and dtype == torch.float32 else None
    return FusedElementwise(ops) if ops is not None else TorchElementwise()
