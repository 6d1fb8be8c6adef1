"""Compiled CPU kernels, built from `csrc/` with the system C++ compiler on first use.

The shared library is cached under `$TANDEM_CACHE/kernels/`, keyed by the source, the
flags, the compiler's version and the CPU (the build is `-march=native`), so a second
start loads it without compiling. The kernels take raw pointers through `ctypes`; they
share torch's OpenMP runtime (torch loads `libgomp.so.1` first, the library links the same
soname). `-ffast-math` applies when compiling only: linking with it would switch the whole
process to flush-denormals-to-zero.

`paged_decode_kernel()` returns None, with one warning, when there is no compiler or the
build fails; `TANDEM_CPU_KERNELS=0` turns the kernels off. Callers then use torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.core.worker.model_files import cache_root

logger = logging.getLogger("tandem.worker")

CSRC = Path(__file__).resolve().parent / "csrc"
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")
#: The KV pool dtypes the decode kernel reads.
KERNEL_POOL_DTYPES = (torch.float32, torch.bfloat16)
PAGED_DECODE_ABI = 3


def _cpu_identity() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    fields = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(fields)))


def build_library(source: Path, compiler: str) -> Path:
    """Compile `source` into a cached shared library and return its path."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256(
        "\0".join(
            [source.read_text(), *COMPILE_FLAGS, *LINK_FLAGS, version, _cpu_identity()]
        ).encode()
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    obj = target.with_suffix(f".{os.getpid()}.o")
    tmp = target.with_suffix(f".{os.getpid()}.so")
    try:
        for cmd in (
            [compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
            [compiler, *LINK_FLAGS, str(obj), "-o", str(tmp)],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders agree on the result
    finally:
        obj.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return target


def load_library(source: str, abi_symbol: str, abi: int, fallback: str) -> ctypes.CDLL | None:
    """`csrc/<source>` built and loaded, or None with one warning naming `fallback` (what
    callers use instead): `TANDEM_CPU_KERNELS=0`, no C++ compiler, a failed build, or an
    ABI version (`abi_symbol()`) other than `abi`."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        logger.warning("no C++ compiler found for %s: using %s", source, fallback)
        return None
    try:
        library = ctypes.CDLL(str(build_library(CSRC / source, compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("%s unavailable, using %s: %s", source, fallback, exc)
        return None
    if getattr(library, abi_symbol)() != abi:
        logger.warning("%s ABI mismatch, using %s", source, fallback)
        return None
    return library


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
    return PagedDecodeKernel(*functions)
