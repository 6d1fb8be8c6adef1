"""Linear layers whose weight is packed once into 16-column panels, float32 compute.

One compiled kernel (`csrc/panel_gemm.cpp`) serves two weight formats:

- `F32PanelLinear`: float32 panels `[ceil(out / 16), in, 16]`, natural column order. The
  fp32 path's linears: the 6x16 AVX2 register tile beats oneDNN at decode row counts
  (`python benchmarks/panel_linear.py --weights float32`).
- `Bf16Linear`: bf16 panels of the same shape (columns interleaved, see the C source),
  for CPUs without bf16 arithmetic: half the bytes of float32, each weight widened to
  float32 in registers (a 16-bit shift). Where oneDNN refuses bf16 weights and `F.linear`
  in bf16 runs ~8x slower than float32, this is the fast way to hold a model in bf16
  (`python benchmarks/panel_linear.py --weights bfloat16`).

Contract (both): `layer(x)` for 2-D float32 `x [rows, in]` equals
`x @ dense_weight().float().T + bias` up to float32 summation order (float32 FMA
accumulation); `dense_weight()` returns the stored weight exactly (float32, or the
weight rounded to bf16 as torch's `.bfloat16()` rounds). The caller's weight is not kept.

Without the kernel (no C++ compiler, a failed build, or `TANDEM_CPU_KERNELS=0`:
`available()` is False) a layer keeps the plain weight in its format instead (`weight`,
with `packed` None) and computes `F.linear(x, weight.float(), bias)`: the same numbers up
to summation order (for bf16, slower, with a float32 copy of the weight during each call).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from tandem.models.cpu_kernels import load_library

PANEL_GEMM_ABI = 5
#: Output columns per packed panel.
PANEL = 16


@dataclass(frozen=True)
class PanelGemmKernel:
    """The entry points of `csrc/panel_gemm.cpp` (see its header for the layouts)."""

    f32_gemm: ctypes._CFuncPtr  # type: ignore[name-defined]
    bf16_gemm: ctypes._CFuncPtr  # type: ignore[name-defined]
    f32_pack: ctypes._CFuncPtr  # type: ignore[name-defined]
    bf16_pack_f32: ctypes._CFuncPtr  # type: ignore[name-defined]
    bf16_pack_bf16: ctypes._CFuncPtr  # type: ignore[name-defined]
    q_gemm: ctypes._CFuncPtr  # type: ignore[name-defined]
    q_dequant_panel: ctypes._CFuncPtr  # type: ignore[name-defined]
    #: `q_gemm_set_wide(0 | 1) -> previous`: products above 32 rows on the wide AVX-512
    #: tile or the narrow one (process-wide; `quant_linear.choose_wide_tile`).
    q_gemm_set_wide: ctypes._CFuncPtr  # type: ignore[name-defined]
    vectorized: bool


def _bind(library: ctypes.CDLL) -> PanelGemmKernel:
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    gemm_args = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32]
    pack_args = [ptr, i64, ptr, i64, i64, i32]
    q_gemm_args = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32, i32, i32, i32]
    q_dequant_args = [ptr, ptr, ptr, i64, i64, i64, i32, i32, i64, ptr, i32]
    functions = {}
    for name, args in (
        ("tandem_f32_gemm", gemm_args),
        ("tandem_bf16_gemm", gemm_args),
        ("tandem_f32_pack", pack_args),
        ("tandem_bf16_pack_f32", pack_args),
        ("tandem_bf16_pack_bf16", pack_args),
        ("tandem_q_gemm", q_gemm_args),
        ("tandem_q_dequant_panel", q_dequant_args),
    ):
        fn = getattr(library, name)
        fn.argtypes, fn.restype = args, None
        functions[name.removeprefix("tandem_")] = fn
    set_wide = library.tandem_q_gemm_set_wide
    set_wide.argtypes, set_wide.restype = [i32], i32
    functions["q_gemm_set_wide"] = set_wide
    return PanelGemmKernel(**functions, vectorized=bool(library.tandem_panel_gemm_vectorized()))


@functools.cache
def panel_gemm_kernel() -> PanelGemmKernel | None:
    """The compiled kernel, or None (one warning) without a compiler, on a failed build, an
    ABI mismatch, or with `TANDEM_CPU_KERNELS=0`."""
    library = load_library(
        "panel_gemm.cpp",
        "tandem_panel_gemm_abi_version",
        PANEL_GEMM_ABI,
        "torch linears (oneDNN prepacked, or F.linear)",
    )
    return _bind(library) if library is not None else None


def available() -> bool:
    """Whether panel layers run on the compiled kernel (else their torch fallback)."""
    return panel_gemm_kernel() is not None


def pack_weight(kernel: PanelGemmKernel, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight [out, in]` (CPU, any float dtype) as `dtype` panels `[ceil(out/16), in, 16]`,
    columns past `out` zero. float32: other dtypes converted first. bfloat16: float32 rounds
    to nearest even (torch's `.bfloat16()`), bfloat16 is copied bit for bit, other dtypes go
    through `.bfloat16()` first."""
    if dtype == torch.float32:
        weight = weight.float()
        pack = kernel.f32_pack
    elif dtype == torch.bfloat16:
        if weight.dtype not in (torch.float32, torch.bfloat16):
            weight = weight.bfloat16()
        pack = kernel.bf16_pack_f32 if weight.dtype == torch.float32 else kernel.bf16_pack_bf16
    else:
        raise ValueError(f"panel weights are float32 or bfloat16, got {dtype}")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out_features, in_features = weight.shape
    packed = torch.empty(-(-out_features // PANEL), in_features, PANEL, dtype=dtype)
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
    """The `[out, in]` weight held in `packed`, in its dtype (exact: the inverse of
    `pack_weight`). bf16 panels: position 2i of a panel row is column i, 2i + 1 column 8 + i."""
    panels, in_features, _ = packed.shape
    if packed.dtype == torch.bfloat16:
        columns = packed.view(panels, in_features, PANEL // 2, 2).permute(0, 3, 2, 1)
    else:
        columns = packed.permute(0, 2, 1)
    return columns.reshape(panels * PANEL, in_features)[:out_features].contiguous()


class PanelLinear:
    """`y = x @ W.T + bias` for 2-D float32 `x [rows, in]`, W held once as `weight_dtype`.

    After construction exactly one of `packed` (kernel panels) and `weight` (plain
    `[out, in]` in `weight_dtype`, fallback only) is set; `bias` is the caller's bias as
    contiguous float32 (the same tensor when it already is), or None. The fallback's
    `weight` is the caller's tensor itself when that is already contiguous in
    `weight_dtype`, else a copy.
    """

    weight_dtype: ClassVar[torch.dtype]

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = weight.detach()
        name = type(self).__name__
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"{name} needs a 2-D CPU weight, got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.bias = bias.detach().float().contiguous() if bias is not None else None
        self._kernel = panel_gemm_kernel()
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        if self._kernel is not None:
            self.packed = pack_weight(self._kernel, weight, self.weight_dtype)
        else:
            self.weight = weight.to(self.weight_dtype).contiguous()

    def dense_weight(self) -> torch.Tensor:
        """The `[out, in]` weight in `weight_dtype`: the kept tensor, or a new one unpacked
        exactly."""
        if self.weight is not None:
            return self.weight
        assert self.packed is not None
        return unpack_weight(self.packed, self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__}({self.in_features}->{self.out_features}) takes "
                f"float32 [rows, {self.in_features}], got {x.dtype} {tuple(x.shape)}"
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
        gemm = (
            self._kernel.f32_gemm if self.weight_dtype == torch.float32 else self._kernel.bf16_gemm
        )
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
            int(portable),
        )
        return y


class F32PanelLinear(PanelLinear):
    """Float32 panels: the fp32 CPU path's linears (`linear_choice.cpu_f32_linear`)."""

    weight_dtype = torch.float32


class Bf16Linear(PanelLinear):
    """bf16 panels, float32 compute: bf16 weights on CPUs without bf16 arithmetic
    (`linear_choice.cpu_bf16_linear`)."""

    weight_dtype = torch.bfloat16
