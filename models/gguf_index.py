"""A GGUF file's tensor directory and scalar metadata, read without materialising its arrays.

gguf's `GGUFReader` builds a numpy view for every element of every metadata array; the
embedded SmolLM2's tokenizer arrays (49,152 tokens, 48,900 merges) make that about 160 MB of
Python objects, at load and at every architecture lookup. `GGUFIndex` walks the same header
with `struct` over a read-only mapping of the file: array values are skipped (their strings
are stepped over by length), scalar and string values are kept in `fields`, and each
tensor's data is a numpy view into the mapping, shaped as gguf's reader shapes it (the GGUF
dimensions reversed; for quantized types the last one in bytes).
Pages of the mapping that were read count in the process's resident memory until the map
is closed; a reader that has copied a tensor out calls `drop_resident_pages()` to drop them
at once (they stay in the page cache, and a later read faults them back in).

Little-endian GGUF versions 2 and 3 are read (what gguf's reader reads, less the
byte-swapped files); anything else raises `ValueError` naming what was found.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

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


class GGMLQuantizationType(IntEnum):
    """GGML's tensor types by their ids in a GGUF's tensor directory (gguf's enum of the
    same name; held equal to it by `tests/model/test_gguf_index.py`). Defined here so that
    reading a GGUF imports no gguf: its package pulls in sentencepiece and numpy's typing,
    about 2.7 MB of resident memory."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


_T = GGMLQuantizationType
#: (elements, bytes) per block of each type (gguf's `GGML_QUANT_SIZES`).
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    _T.F32: (1, 4),
    _T.F16: (1, 2),
    _T.Q4_0: (32, 18),
    _T.Q4_1: (32, 20),
    _T.Q5_0: (32, 22),
    _T.Q5_1: (32, 24),
    _T.Q8_0: (32, 34),
    _T.Q8_1: (32, 40),
    _T.Q2_K: (256, 84),
    _T.Q3_K: (256, 110),
    _T.Q4_K: (256, 144),
    _T.Q5_K: (256, 176),
    _T.Q6_K: (256, 210),
    _T.Q8_K: (256, 292),
    _T.IQ2_XXS: (256, 66),
    _T.IQ2_XS: (256, 74),
    _T.IQ3_XXS: (256, 98),
    _T.IQ1_S: (256, 50),
    _T.IQ4_NL: (32, 18),
    _T.IQ3_S: (256, 110),
    _T.IQ2_S: (256, 82),
    _T.IQ4_XS: (256, 136),
    _T.I8: (1, 1),
    _T.I16: (1, 2),
    _T.I32: (1, 4),
    _T.I64: (1, 8),
    _T.F64: (1, 8),
    _T.IQ1_M: (256, 56),
    _T.BF16: (1, 2),
    _T.TQ1_0: (256, 54),
    _T.TQ2_0: (256, 66),
    _T.MXFP4: (32, 17),
    _T.NVFP4: (64, 36),
    _T.Q1_0: (128, 18),
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
        self.path = Path(path)
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
        type_id = self._read("<I")
        if type_id not in GGML_QUANT_SIZES:
            raise ValueError(f"{self.path}: tensor {name!r} has unknown GGML type id {type_id}")
        return name, dims, GGMLQuantizationType(type_id), self._read("<Q")

    def _tensor(
        self, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, at: int
    ) -> GGUFTensor:
        elements = int(np.prod(dims)) if dims else 1
        shape = tuple(reversed(dims))
        dtype = _PLAIN.get(kind)
        if dtype is None:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            if shape[-1] % block_size:
                raise ValueError(
                    f"{self.path}: tensor {name!r}: row of {shape[-1]} is not a whole number "
                    f"of {kind.name} blocks ({block_size})"
                )
            count, dtype = elements * type_size // block_size, np.uint8
            shape = (*shape[:-1], shape[-1] // block_size * type_size)
        else:
            count = elements
        data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start + at)
        return GGUFTensor(name, kind, dims, data.reshape(shape), start + at)

    def drop_resident_pages(self) -> None:
        """Drop every page of the file mapping from this process's resident memory
        (`madvise(MADV_DONTNEED)` on the read-only mapping); the data stays readable: the
        next access reads the pages back from the page cache or the file. The whole mapping,
        not one tensor's range: a page fault maps the neighbours of the page it reads too
        (the kernel's fault-around, 64 KiB or a large folio), so dropping only the range of
        the tensor just copied would leave the tail of the one before it mapped, about
        60 KiB per tensor (13 MB over the embedded SmolLM2's 272 tensors). Nothing happens
        where the platform has no `madvise`."""
        advise = getattr(self._map, "madvise", None)
        if advise is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        advise(mmap.MADV_DONTNEED, 0, len(self._map))

    def architecture(self) -> str:
        """`general.architecture`, or "" when the file does not name one."""
        value = self.fields.get("general.architecture", "")
        return value if isinstance(value, str) else ""
