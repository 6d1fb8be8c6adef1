"""Linear layers with bf16 weights and float32 compute, for CPUs without bf16 arithmetic.

`Bf16Linear` keeps one bf16 copy of its weight (half the bytes of float32) and computes
`x @ W.T + bias` with float32 activations and float32 FMA accumulation: the compiled kernel
(`csrc/bf16_gemm.cpp`) widens each bf16 weight to float32 in registers (a 16-bit shift).
Where oneDNN refuses bf16 weights (no avx512bw / avx_ne_convert) and `F.linear` in bf16
runs ~8x slower than float32, this is the fast way to hold a model in bf16.

The weight is packed once into the kernel's panel layout (`packed`, a bfloat16 tensor
`[ceil(out / 16), in, 16]`, columns interleaved as described in the C source). The
caller's weight is not kept. Results equal `x @ dense_weight().float().T + bias` up to
float32 summation order.

Without the kernel (no C++ compiler, a failed build, or `TANDEM_CPU_KERNELS=0`:
`available()` is False) the layer keeps the plain bf16 weight instead (`weight`, with
`packed` None) and computes `F.linear(x, weight.float(), bias)` per call: the same numbers
up to summation order, slower, and a float32 copy of the weight exists during each call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.core.worker.cpu_kernels import load_library

logger = logging.getLogger("tandem.worker")

BF16_GEMM_ABI = 1
#: Output columns per packed panel.
PANEL = 16


@dataclass(frozen=True)
class Bf16GemmKernel:
    """The entry points of `csrc/bf16_gemm.cpp` (see its header for the layout)."""

    gemm: ctypes._CFuncPtr  # type: ignore[name-defined]
    gemm_portable: ctypes._CFuncPtr  # type: ignore[name-defined]
    pack_f32: ctypes._CFuncPtr  # type: ignore[name-defined]
    pack_bf16: ctypes._CFuncPtr  # type: ignore[name-defined]
    vectorized: bool


def _bind(library: ctypes.CDLL) -> Bf16GemmKernel:
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    gemm_args = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32]
    pack_args = [ptr, i64, ptr, i64, i64, i32]
    functions = {}
    for name, args in (
        ("tandem_bf16_gemm_f32", gemm_args),
        ("tandem_bf16_gemm_f32_portable", gemm_args),
        ("tandem_bf16_pack_f32", pack_args),
        ("tandem_bf16_pack_bf16", pack_args),
    ):
        fn = getattr(library, name)
        fn.argtypes, fn.restype = args, None
        functions[name] = fn
    return Bf16GemmKernel(
        gemm=functions["tandem_bf16_gemm_f32"],
        gemm_portable=functions["tandem_bf16_gemm_f32_portable"],
        pack_f32=functions["tandem_bf16_pack_f32"],
        pack_bf16=functions["tandem_bf16_pack_bf16"],
        vectorized=bool(library.tandem_bf16_gemm_vectorized()),
    )


@functools.cache
def bf16_gemm_kernel() -> Bf16GemmKernel | None:
    """The compiled kernel, or None (one warning) without a compiler, on a failed build, an
    ABI mismatch, or with `TANDEM_CPU_KERNELS=0`."""
    library = load_library(
        "bf16_gemm.cpp", "tandem_bf16_gemm_abi_version", BF16_GEMM_ABI, "float32 F.linear"
    )
    return _bind(library) if library is not None else None


def available() -> bool:
    """Whether `Bf16Linear` runs on the compiled kernel (else its slower torch fallback)."""
    return bf16_gemm_kernel() is not None


def pack_weight(kernel: Bf16GemmKernel, weight: torch.Tensor) -> torch.Tensor:
    """`weight [out, in]` (any float dtype, CPU) as bf16 panels `[ceil(out/16), in, 16]`.

    float32 rounds to nearest even (torch's `.bfloat16()`), bfloat16 is copied bit for
    bit, other dtypes go through torch's `.bfloat16()` first."""
    if weight.dtype not in (torch.float32, torch.bfloat16):
        weight = weight.bfloat16()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out_features, in_features = weight.shape
    packed = torch.empty(-(-out_features // PANEL), in_features, PANEL, dtype=torch.bfloat16)
    pack = kernel.pack_f32 if weight.dtype == torch.float32 else kernel.pack_bf16
    pack(
        weight.data_ptr(),
        weight.stride(0),
        packed.data_ptr(),
        out_features,
        in_features,
        torch.get_num_threads(),
    )
    return packed


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The bf16 `[out, in]` weight held in `packed` (exact: the inverse of `pack_weight`).

    Position 2i of a panel row is column i, position 2i + 1 column 8 + i."""
    panels, in_features, _ = packed.shape
    columns = packed.view(panels, in_features, PANEL // 2, 2).permute(0, 3, 2, 1)
    return columns.reshape(panels * PANEL, in_features)[:out_features].contiguous()


class Bf16Linear:
    """`y = x @ W.T + bias` for 2-D float32 `x [rows, in]`, W held once in bf16.

    After construction exactly one of `packed` (kernel panels) and `weight` (plain bf16
    `[out, in]`, fallback only) is set; `bias` is the caller's bias as contiguous float32
    (the same tensor when it already is), or None. With the kernel the caller's weight is
    not referenced; the fallback's `weight` is the caller's tensor itself when that is
    already contiguous bfloat16 (as `PackedLinear` keeps its plain weight), else a copy.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = weight.detach()
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"Bf16Linear needs a 2-D CPU weight, got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.bias = bias.detach().float().contiguous() if bias is not None else None
        self._kernel = bf16_gemm_kernel()
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        if self._kernel is not None:
            self.packed = pack_weight(self._kernel, weight)
        else:
            self.weight = weight.bfloat16().contiguous()

    def dense_weight(self) -> torch.Tensor:
        """The bf16 `[out, in]` weight: the kept tensor, or a new one unpacked exactly."""
        if self.weight is not None:
            return self.weight
        assert self.packed is not None
        return unpack_weight(self.packed, self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"Bf16Linear({self.in_features}->{self.out_features}) takes float32 "
                f"[rows, {self.in_features}], got {x.dtype} {tuple(x.shape)}"
            )
        if self.packed is None:
            assert self.weight is not None
            return F.linear(x, self.weight.float(), self.bias)
        return self.run(x, portable=False)

    def run(self, x: torch.Tensor, portable: bool = False) -> torch.Tensor:
        """The kernel's product (`portable`: its plain-loop tile, for tests)."""
        assert self._kernel is not None and self.packed is not None
        rows = x.shape[0]
        if x.stride(1) != 1 or (rows > 1 and x.stride(0) < self.in_features):
            x = x.contiguous()
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        gemm = self._kernel.gemm_portable if portable else self._kernel.gemm
        gemm(
            x.data_ptr(),
            x.stride(0),
            self.packed.data_ptr(),
            self.bias.data_ptr() if self.bias is not None else None,
            y.data_ptr(),
            self.out_features,
            rows,
            self.out_features,
            self.in_features,
            torch.get_num_threads(),
        )
        return y
