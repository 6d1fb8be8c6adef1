"""Building and loading the C++ sources in `csrc/` with the system compiler (no torch).

A shared library is cached under `$TANDEM_CACHE/kernels/`, keyed by the source, the flags,
the compiler's version and the CPU (the build is `-march=native`), so a second start loads
it without compiling. `-ffast-math` applies when compiling only: linking with it would
switch the whole process to flush-denormals-to-zero. The libraries share torch's OpenMP
runtime (torch loads `libgomp.so.1` first, a library links the same soname).

This module imports neither torch nor anything that does, so resolving a config (the
thread pinning check in `cpu_affinity`) stays light; the kernels' tensor wrappers are in
`cpu_kernels`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

from tandem.schema.cache_dir import cache_root

logger = logging.getLogger("tandem.worker")

#: The worker's own C++ sources (thread placement); model kernels live in `tandem.models`.
CSRC = Path(__file__).resolve().parent / "csrc"
#: `-mprefer-vector-width=512`: where the CPU has AVX-512, the `omp simd` loops and libmvec's
#: `exp` use 16 lanes (GCC's tuning for recent Xeons otherwise keeps auto-vectorised code at
#: 256 bits); on an AVX2-only CPU it changes nothing.
COMPILE_FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-ffast-math",
    "-fopenmp",
    "-fPIC",
    "-std=c++17",
)
LINK_FLAGS = ("-shared", "-fopenmp")


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


def load_library(source: Path, abi_symbol: str, abi: int, fallback: str) -> ctypes.CDLL | None:
    """The C++ file `source` built and loaded, or None with one warning naming `fallback` (what
    callers use instead): `TANDEM_CPU_KERNELS=0`, no C++ compiler, a failed build, or an
    ABI version (`abi_symbol()`) other than `abi`."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if compiler is None:
        logger.warning("no C++ compiler found for %s: using %s", source.name, fallback)
        return None
    try:
        library = ctypes.CDLL(str(build_library(source, compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("%s unavailable, using %s: %s", source.name, fallback, exc)
        return None
    if getattr(library, abi_symbol)() != abi:
        logger.warning("%s ABI mismatch, using %s", source.name, fallback)
        return None
    return library
