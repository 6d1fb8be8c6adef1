"""A GGUF file's tensor directory and scalar metadata, read without materialising its arrays.

gguf's `GGUFReader` builds a numpy view for every element of every metadata array; the
embedded SmolLM2's tokenizer arrays (49,152 tokens, 48,900 merges) make that about 160 MB of
Python objects, at load and at every architecture lookup. `GGUFIndex` walks the same header
with `struct` over a read-only mapping of the file: array values are skipped (their strings
are stepped over by length), scalar and string values are kept in `fields`, and each
tensor's data is a numpy view into the mapping, shaped as gguf's reader shapes it (the GGUF
dimensions reversed; for quantized types the last one in bytes, `quant_shape_to_byte_shape`).
Pages of the mapping that were read count in the process's resident memory until the map
is closed; a reader that has copied a tensor out calls `release(tensor)` to drop them at
once (they stay in the page cache, and a later read faults them back in).

Little-endian GGUF versions 2 and 3 are read (what gguf's reader reads, less the
byte-swapped files); anything else raises `ValueError` naming what was found.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
#: struct formats of GGUF's fixed-size value types (`gguf.GGUFValueType`).
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
#: numpy dtypes of the unquantized tensor types, as gguf's reader gives them.
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF order (fastest dimension first); `data` a read-only view
    of its bytes in the file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    #: Where `data` starts in the file (bytes).
    offset: int = 0


class GGUFIndex:
    """The header of the GGUF at `path` (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._offset = 0
        if self._map[:4] != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {bytes(self._map[:4])!r})")
        try:
            self._read_header(path)
        except struct.error as exc:  # a read past the end of the mapping
            raise ValueError(f"{path}: truncated or corrupt GGUF header ({exc})") from exc

    def _read_header(self, path: str | Path) -> None:
        self._offset = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (little-endian 2 or 3 is read)")
        tensor_count, kv_count = self._read("<Q"), self._read("<Q")
        #: Scalar and string metadata values by key (array values are skipped).
        self.fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            value_type = self._read("<I")
            value = self._value(value_type)
            if value_type != _ARRAY:
                self.fields[key] = value
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment!r} is not a power of two")
        start = -(-self._offset // alignment) * alignment
        #: Every tensor, in file order.
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        size = self._read("<Q")
        text = self._map[self._offset : self._offset + size].decode("utf-8", errors="replace")
        self._offset += size
        return text

    def _value(self, value_type: int) -> Any:
        """The value at the cursor (None for an array, which is stepped over)."""
        if value_type in _SCALARS:
            return self._read(_SCALARS[value_type])
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise ValueError(f"GGUF metadata value type {value_type} is not known")
        item_type, count = self._read("<I"), self._read("<Q")
        if item_type in _SCALARS:
            self._offset += count * struct.calcsize(_SCALARS[item_type])
        elif item_type == _STRING:
            for _ in range(count):
                self._offset += 8 + struct.unpack_from("<Q", self._map, self._offset)[0]
        else:
            for _ in range(count):
                self._value(item_type)
        return None

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._read("<Q") for _ in range(self._read("<I")))
        return name, dims, GGMLQuantizationType(self._read("<I")), self._read("<Q")

    def _tensor(
        self, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, at: int
    ) -> GGUFTensor:
        elements = int(np.prod(dims)) if dims else 1
        shape = tuple(reversed(dims))
        dtype = _PLAIN.get(kind)
        if dtype is None:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            count, dtype = elements * type_size // block_size, np.uint8
            shape = quant_shape_to_byte_shape(shape, kind)
        else:
            count = elements
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start + at)
        return GGUFTensor(name, kind, dims, data.reshape(shape), start + at)

    def release(self, tensor: GGUFTensor) -> None:
        """Drop `tensor`'s pages (rounded out to whole pages) from this process's resident
        memory: `madvise(MADV_DONTNEED)` on the read-only file mapping. Its data stays
        readable: the next access reads the pages back from the page cache or the file.
        Nothing happens where the platform has no `madvise`."""
        advise = getattr(self._map, "madvise", None)
        if advise is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = tensor.offset - tensor.offset % mmap.PAGESIZE
        end = min(tensor.offset + tensor.data.nbytes, len(self._map))
        if end > first:
            advise(mmap.MADV_DONTNEED, first, end - first)

    def architecture(self) -> str:
        """`general.architecture`, or "" when the file does not name one."""
        value = self.fields.get("general.architecture", "")
        return value if isinstance(value, str) else ""
