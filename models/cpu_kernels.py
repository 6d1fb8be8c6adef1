"""Compiled CPU kernels' tensor wrappers: the paged decode attention kernel.

The sources in `csrc/` are built and loaded by `native_build` (torch-free; its names are
re-exported here for the modules that load their own kernels). The kernels take raw
pointers through `ctypes`; they share torch's OpenMP runtime.

`paged_decode_kernel()` returns None, with one warning, when there is no compiler or the
build fails; `TANDEM_CPU_KERNELS=0` turns the kernels off. Callers then use torch.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.core.worker import native_build
from tandem.core.worker.native_build import (  # noqa: F401 - re-exported
    COMPILE_FLAGS,
    LINK_FLAGS,
    build_library,
)

#: The model kernels' C++ sources.
CSRC = Path(__file__).resolve().parent / "csrc"


def load_library(source: str, abi_symbol: str, abi: int, fallback: str) -> ctypes.CDLL | None:
    """`csrc/<source>` of this package built and loaded (`native_build.load_library`)."""
    return native_build.load_library(CSRC / source, abi_symbol, abi, fallback)


#: The KV pool dtypes the decode kernel reads.
KERNEL_POOL_DTYPES = (torch.float32, torch.bfloat16)
PAGED_DECODE_ABI = 5


@dataclass(frozen=True)
class PagedDecodeKernel:
    """`csrc/paged_decode.cpp`: decode attention reading the paged pools in place.

    Key pools are laid out `[num_blocks, kv_heads, head_dim, block_size]`, value pools
    `[num_blocks, block_size, kv_heads, head_dim]`; contiguous CPU tensors, both float32
    (`function`) or both bfloat16 (`function_bf16`: read as raw bits, widened to float32 in
    the kernel, float32 scores and accumulation). Queries and the output are float32.
    """

    function: ctypes._CFuncPtr  # type: ignore[name-defined]
    function_bf16: ctypes._CFuncPtr  # type: ignore[name-defined]
    write_function: ctypes._CFuncPtr  # type: ignore[name-defined]
    write_function_bf16: ctypes._CFuncPtr  # type: ignore[name-defined]

    def write_kv(
        self,
        key_pool: torch.Tensor,
        value_pool: torch.Tensor,
        key: torch.Tensor,  # [T, kv_heads, head_dim]
        value: torch.Tensor,
        slots: torch.Tensor,  # [T] int64, contiguous
    ) -> bool:
        """Store float32 `key`/`value` rows at `slots` of float32 or bfloat16 pools (rounded
        as torch's cast rounds) in one pass; False (nothing written) when the dtypes or
        strides are not the kernel's: the caller uses torch."""
        if key_pool.dtype != value_pool.dtype or key_pool.dtype not in KERNEL_POOL_DTYPES:
            return False
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            return False
        num_tokens, kv_heads, head_dim = key.shape
        for rows in (key, value):
            if rows.dtype != torch.float32 or rows.stride()[1:] != (head_dim, 1):
                return False
        if num_tokens:
            write = (
                self.write_function if key_pool.dtype == torch.float32 else self.write_function_bf16
            )
            write(
                key_pool.data_ptr(),
                value_pool.data_ptr(),
                key.data_ptr(),
                value.data_ptr(),
                slots.data_ptr(),
                num_tokens,
                key.stride(0),
                value.stride(0),
                kv_heads,
                head_dim,
                key_pool.shape[-1],
            )
        return True

    def __call__(
        self,
        query: torch.Tensor,  # [R, Hq, D]
        key_pool: torch.Tensor,
        value_pool: torch.Tensor,
        block_tables: torch.Tensor,  # [R, max_blocks] int64
        seq_lens: torch.Tensor,  # [R] int64
        scale: float,
    ) -> torch.Tensor:
        """Attention output `[R, Hq, D]` of each request's single query token, in the
        query's dtype (computed in float32)."""
        if key_pool.dtype != value_pool.dtype or key_pool.dtype not in KERNEL_POOL_DTYPES:
            raise TypeError(f"decode kernel pools must be float32 or bfloat16: {key_pool.dtype}")
        query_dtype = query.dtype
        query = query.float().contiguous()
        num_requests, q_heads, head_dim = query.shape
        _, kv_heads, _, block_size = key_pool.shape
        out = torch.empty_like(query)
        function = self.function if key_pool.dtype == torch.float32 else self.function_bf16
        if num_requests:
            function(
                query.data_ptr(),
                key_pool.data_ptr(),
                value_pool.data_ptr(),
                block_tables.data_ptr(),
                seq_lens.data_ptr(),
                out.data_ptr(),
                num_requests,
                q_heads,
                kv_heads,
                head_dim,
                block_size,
                block_tables.shape[1],
                scale,
                torch.get_num_threads(),
            )
        return out.to(query_dtype)


@functools.cache
def paged_decode_kernel() -> PagedDecodeKernel | None:
    library = load_library(
        "paged_decode.cpp", "tandem_paged_decode_abi_version", PAGED_DECODE_ABI, "torch SDPA"
    )
    if library is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    functions = (library.tandem_paged_decode_f32, library.tandem_paged_decode_bf16)
    for fn in functions:
        fn.argtypes = [ptr] * 6 + [i64] * 6 + [ctypes.c_float, ctypes.c_int]
        fn.restype = None
    writes = (library.tandem_write_kv_f32, library.tandem_write_kv_bf16)
    for write in writes:
        write.argtypes = [ptr] * 5 + [i64] * 6
        write.restype = None
    return PagedDecodeKernel(*functions, *writes)
