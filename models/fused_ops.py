"""Fused element-wise ops of the decoder layer (`csrc/fused_ops.cpp`), float32 CPU.

The `*_bf16` methods take or give bfloat16 where a bf16 linear produced or will read the
tensor (float32 arithmetic in between); each equals its float32 method combined with
torch's casts, bit for bit.

`fused_ops()` returns the loaded kernels, or None (once logged) when there is no C++
compiler, the build fails, or `TANDEM_CPU_KERNELS=0`; `FusedDecoder` then runs the same
math as torch ops. Each method checks what its C function assumes (float32, contiguous
rows, matching sizes) and raises `ValueError` otherwise, so a wrong call never reads out of
bounds. The thread count is torch's, read per call, so `torch.set_num_threads` applies.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from tandem.models.cpu_kernels import load_library

logger = logging.getLogger("tandem.worker")

FUSED_OPS_ABI = 3


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    if tensor.dtype != dtype or tensor.device.type != "cpu":
        raise ValueError(
            f"{name}: expected a {str(dtype).removeprefix('torch.')} CPU tensor, got "
            f"{tensor.dtype} on {tensor.device}"
        )
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


@dataclass(frozen=True)
class FusedOps:
    """The C functions, wrapped; see `csrc/fused_ops.cpp` for their exact arithmetic."""

    library: ctypes.CDLL

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`weight * (x * rsqrt(mean(x**2, -1) + eps))` for `x [rows, cols]`."""
        _check("x", x)
        _check("weight", weight)
        rows, cols = x.shape
        out = torch.empty_like(x)
        self.library.tandem_rms_norm_f32(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, cols, eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm_(
        self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """`h += delta` in place (the residual stream), then the RMS norm of `h`."""
        for name, t in (("h", h), ("delta", delta), ("weight", weight)):
            _check(name, t)
        if delta.shape != h.shape:
            raise ValueError(f"delta: expected shape {tuple(h.shape)}, got {tuple(delta.shape)}")
        rows, cols = h.shape
        out = torch.empty_like(h)
        self.library.tandem_add_rms_norm_f32(
            h.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, cols, eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rope_(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_heads: int,
        kv_heads: int,
    ) -> None:
        """Rotate the query and key heads at the start of each `qkv [rows, width]` row in
        place by the rows `positions` of `cos`/`sin [num_positions, head_dim]`."""
        for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin)):
            _check(name, t)
        positions = self._checked_positions(qkv, positions, cos, sin, q_heads, kv_heads)
        self.library.tandem_rope_f32(
            qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            qkv.shape[0], qkv.shape[1], q_heads, kv_heads, cos.shape[1], torch.get_num_threads(),
        )  # fmt: skip

    @staticmethod
    def _checked_positions(
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_heads: int,
        kv_heads: int,
    ) -> torch.Tensor:
        """`positions` made contiguous, after checking the rope arguments' shapes and range."""
        if (q_heads + kv_heads) * cos.shape[1] > qkv.shape[1] or sin.shape != cos.shape:
            raise ValueError("rope: qkv rows are narrower than the rotated heads")
        if positions.dtype != torch.int64 or positions.shape != (qkv.shape[0],):
            raise ValueError("positions: expected int64 [rows]")
        positions = positions.contiguous()
        if positions.numel() and int(positions.max()) >= cos.shape[0]:
            raise ValueError(f"positions: beyond the {cos.shape[0]} cached rotary positions")
        return positions

    def rope_bf16(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_heads: int,
        kv_heads: int,
    ) -> torch.Tensor:
        """`qkv.float()` with `rope_` applied, in one pass, for a bfloat16 `qkv [rows, width]`
        (a new float32 tensor; `qkv` is not changed)."""
        _check("qkv", qkv, torch.bfloat16)
        for name, t in (("cos", cos), ("sin", sin)):
            _check(name, t)
        positions = self._checked_positions(qkv, positions, cos, sin, q_heads, kv_heads)
        out = torch.empty(qkv.shape, dtype=torch.float32)
        self.library.tandem_rope_bf16(
            qkv.data_ptr(), out.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            qkv.shape[0], qkv.shape[1], q_heads, kv_heads, cos.shape[1], torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` where each row of `gate_up [rows, 2 * cols]` is `[gate | up]`."""
        _check("gate_up", gate_up)
        rows, width = gate_up.shape
        out = gate_up.new_empty((rows, width // 2))
        self.library.tandem_silu_mul_f32(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        return out

    def rms_norm_bf16(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`rms_norm(x, weight, eps).to(torch.bfloat16)` in one pass."""
        _check("x", x)
        _check("weight", weight)
        rows, cols = x.shape
        out = torch.empty((rows, cols), dtype=torch.bfloat16)
        self.library.tandem_rms_norm_bf16(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, cols, eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm_bf16_(
        self,
        h: torch.Tensor,
        delta: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """`add_rms_norm_(h, delta.float(), weight, eps)` for a bfloat16 `delta`, the norm
        returned in `out_dtype` (bfloat16 or float32)."""
        _check("h", h)
        _check("delta", delta, torch.bfloat16)
        _check("weight", weight)
        if delta.shape != h.shape:
            raise ValueError(f"delta: expected shape {tuple(h.shape)}, got {tuple(delta.shape)}")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"out_dtype: expected bfloat16 or float32, got {out_dtype}")
        rows, cols = h.shape
        out = torch.empty((rows, cols), dtype=out_dtype)
        self.library.tandem_add_rms_norm_bf16(
            h.data_ptr(), delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
            int(out_dtype == torch.bfloat16), rows, cols, eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_mul_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu_mul(gate_up.float()).to(torch.bfloat16)` for a bfloat16 `gate_up`."""
        _check("gate_up", gate_up, torch.bfloat16)
        rows, width = gate_up.shape
        out = gate_up.new_empty((rows, width // 2))
        self.library.tandem_silu_mul_bf16(
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        return out


def _declare(library: ctypes.CDLL) -> None:
    ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "tandem_rms_norm_f32": [ptr, ptr, ptr, i64, i64, f32, i32],
        "tandem_add_rms_norm_f32": [ptr, ptr, ptr, ptr, i64, i64, f32, i32],
        "tandem_rope_f32": [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32],
        "tandem_silu_mul_f32": [ptr, ptr, i64, i64, i32],
        "tandem_rms_norm_bf16": [ptr, ptr, ptr, i64, i64, f32, i32],
        "tandem_add_rms_norm_bf16": [ptr, ptr, ptr, ptr, i32, i64, i64, f32, i32],
        "tandem_silu_mul_bf16": [ptr, ptr, i64, i64, i32],
        "tandem_rope_bf16": [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32],
    }
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = None


@functools.cache
def fused_ops() -> FusedOps | None:
    library = load_library(
        "fused_ops.cpp", "tandem_fused_ops_abi_version", FUSED_OPS_ABI, "torch ops"
    )
    if library is None:
        return None
    _declare(library)
    return FusedOps(library)
