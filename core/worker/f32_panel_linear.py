"""Linear layers with float32 weights packed into 16-column panels (a candidate to oneDNN).

`F32PanelLinear` packs its weight once into the panel layout of `csrc/f32_gemm.cpp`
(`packed`, float32 `[ceil(out / 16), in, 16]`, natural column order, columns past `out`
zero) and computes `x @ W.T + bias` with the kernel's 6x16 AVX2 register tile, float32
FMA accumulation. It mirrors `Bf16Linear` (same interface and fallback), for decode row
counts where oneDNN's small-M efficiency lags: `benchmarks/f32_panel_linear.py` compares
the two. Not used by the decoder (issue 16 decides).

Results equal `x @ W.T + bias` up to float32 summation order; `dense_weight()` returns the
weight exactly. Without the kernel (no C++ compiler, a failed build, or
`TANDEM_CPU_KERNELS=0`: `available()` is False) the layer keeps the float32 weight instead
(`weight`, with `packed` None) and computes `F.linear(x, weight, bias)`.
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

F32_GEMM_ABI = 1
#: Output columns per packed panel.
PANEL = 16


@dataclass(frozen=True)
class F32GemmKernel:
    """The entry points of `csrc/f32_gemm.cpp` (see its header for the layout)."""

    gemm: ctypes._CFuncPtr  # type: ignore[name-defined]
    gemm_portable: ctypes._CFuncPtr  # type: ignore[name-defined]
    pack: ctypes._CFuncPtr  # type: ignore[name-defined]
    vectorized: bool


def _bind(library: ctypes.CDLL) -> F32GemmKernel:
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    gemm_args = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32]
    functions = {}
    for name, args in (
        ("tandem_f32_gemm", gemm_args),
        ("tandem_f32_gemm_portable", gemm_args),
        ("tandem_f32_pack", [ptr, i64, ptr, i64, i64, i32]),
    ):
        fn = getattr(library, name)
        fn.argtypes, fn.restype = args, None
        functions[name] = fn
    return F32GemmKernel(
        gemm=functions["tandem_f32_gemm"],
        gemm_portable=functions["tandem_f32_gemm_portable"],
        pack=functions["tandem_f32_pack"],
        vectorized=bool(library.tandem_f32_gemm_vectorized()),
    )


@functools.cache
def f32_gemm_kernel() -> F32GemmKernel | None:
    """The compiled kernel, or None (one warning) without a compiler, on a failed build, an
    ABI mismatch, or with `TANDEM_CPU_KERNELS=0`."""
    library = load_library("f32_gemm.cpp", "tandem_f32_gemm_abi_version", F32_GEMM_ABI, "F.linear")
    return _bind(library) if library is not None else None


def available() -> bool:
    """Whether `F32PanelLinear` runs on the compiled kernel (else `F.linear`)."""
    return f32_gemm_kernel() is not None


def pack_weight(kernel: F32GemmKernel, weight: torch.Tensor) -> torch.Tensor:
    """`weight [out, in]` (CPU; other dtypes converted to float32 first) as float32 panels
    `[ceil(out/16), in, 16]`, columns past `out` zero."""
    weight = weight.float()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out_features, in_features = weight.shape
    packed = torch.empty(-(-out_features // PANEL), in_features, PANEL, dtype=torch.float32)
    kernel.pack(
        weight.data_ptr(),
        weight.stride(0),
        packed.data_ptr(),
        out_features,
        in_features,
        torch.get_num_threads(),
    )
    return packed


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float32 `[out, in]` weight held in `packed` (exact: the inverse of
    `pack_weight`)."""
    panels, in_features, _ = packed.shape
    columns = packed.permute(0, 2, 1).reshape(panels * PANEL, in_features)
    return columns[:out_features].contiguous()


class F32PanelLinear:
    """`y = x @ W.T + bias` for 2-D float32 `x [rows, in]`, W held once in float32.

    After construction exactly one of `packed` (kernel panels) and `weight` (float32
    `[out, in]`, fallback only) is set; `bias` is the caller's bias as contiguous float32
    (the same tensor when it already is), or None. With the kernel the caller's weight is
    not referenced; the fallback's `weight` is the caller's tensor itself when that is
    already contiguous float32, else a copy.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = weight.detach()
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"F32PanelLinear needs a 2-D CPU weight, got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.bias = bias.detach().float().contiguous() if bias is not None else None
        self._kernel = f32_gemm_kernel()
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        if self._kernel is not None:
            self.packed = pack_weight(self._kernel, weight)
        else:
            self.weight = weight.float().contiguous()

    def dense_weight(self) -> torch.Tensor:
        """The float32 `[out, in]` weight: the kept tensor, or a new one unpacked exactly."""
        if self.weight is not None:
            return self.weight
        assert self.packed is not None
        return unpack_weight(self.packed, self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"F32PanelLinear({self.in_features}->{self.out_features}) takes float32 "
                f"[rows, {self.in_features}], got {x.dtype} {tuple(x.shape)}"
            )
        if self.packed is None:
            assert self.weight is not None
            return F.linear(x, self.weight, self.bias)
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
