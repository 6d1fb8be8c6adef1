"""What this CPU's instruction set offers the dtypes tandem runs in.

bf16 matrix units: AVX512-BF16 (`avx512_bf16`) or AMX (`amx_bf16`), read from the kernel's
CPU flags. Without them torch computes bfloat16 by converting to float32 and back, which on
CPU is slower than float32 itself.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

logger = logging.getLogger("tandem.worker")

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of the first processor in `/proc/cpuinfo` (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _first_field(key: str, cpuinfo: str | None) -> str:
    """The first processor's `key` field in `/proc/cpuinfo` ("" where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return ""


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The first processor's `vendor_id` in `/proc/cpuinfo` (`GenuineIntel`,
    `AuthenticAMD`, ...; "" where there is none)."""
    return _first_field("vendor_id", cpuinfo)


def cpu_model_name(cpuinfo: str | None = None) -> str:
    """The first processor's `model name` in `/proc/cpuinfo` ("" where there is none)."""
    return _first_field("model name", cpuinfo)


def has_bf16_units(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU computes bfloat16 natively (AVX512-BF16 or AMX)."""
    return any(f in (cpu_flags() if flags is None else flags) for f in BF16_FLAGS)


@functools.cache
def warn_if_bf16_emulated() -> bool:
    """Log once per process that bfloat16 is emulated here; True when it is."""
    if has_bf16_units():
        return False
    logger.warning(
        "model.dtype: bfloat16 on this CPU (no %s) is emulated: weights and the KV cache are "
        "stored in bfloat16 and computed in float32 (weight-only bf16), no faster and often "
        "slower than float32; dtype: auto or float32 is recommended on this CPU",
        " / ".join(BF16_FLAGS),
    )
    return True
