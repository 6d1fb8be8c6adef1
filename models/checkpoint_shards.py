"""A rank's share of a Hugging Face checkpoint, read straight from its safetensors files.

A tensor- or pipeline-parallel rank keeps only some tensors (its stage's layers) and, of
those, only a block of rows or columns (its heads, its intermediate columns, its vocabulary
rows: `tensor_parallel`). `CheckpointShards` reads exactly that block from disk:
`safetensors`' `get_slice` over the `pread` backend copies the rows or columns asked for into
new memory without reading the rest of the tensor, and no file mapping stays behind. The
block is then converted to the model's dtype and device, so a value read here is bit for
bit the value a whole load in that dtype holds (converting is element-wise).

`bytes_read` counts the bytes taken from the files (in the files' own dtype): what this rank
read, shown per rank by `Worker.describe`. A directory with `model.safetensors.index.json`
is read across the files its index names, else every `*.safetensors` file in it.

The fused decoder builds a layer from a `WeightSource`: `CheckpointLayer` (one layer's
tensors in the files) or `ModuleWeights` (a loaded HF layer's parameters, cut in memory:
the path of one rank, and of a checkpoint without safetensors).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Protocol

import torch

from tandem.models.tensor_parallel import shard_cols, shard_rows

SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF directory: those its index names, else every
    `*.safetensors` file in it (empty when it has none, e.g. `pytorch_model.bin` only)."""
    index = model_dir / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    return sorted(model_dir.glob("*.safetensors"))


def _header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: name -> {dtype, shape, data_offsets} (no tensor data)."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def checkpoint_bytes(model_dir: Path) -> int | None:
    """Bytes of every tensor in the directory's weights, as stored: a whole load reads this
    much. From the safetensors headers, else the size of `pytorch_model*.bin`; None when
    the directory has neither."""
    files = safetensors_files(model_dir)
    if files:
        return sum(CheckpointShards(model_dir).nbytes.values())
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    return sum(p.stat().st_size for p in bins) if bins else None


def _open(path: Path) -> Any:
    """`safe_open` over `pread` (a slice is copied out, nothing stays mapped); the default
    `mmap` backend where this safetensors has no `backend` (`read` then copies the slice)."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", backend="pread")
    except TypeError:
        return safe_open(str(path), framework="pt")


class CheckpointShards:
    """Reads tensors, or blocks of their rows or columns, from an HF directory's safetensors
    files into `dtype` on `device` (the files' own dtype and the CPU when not given).

    Every tensor returned is new memory of exactly its shape (contiguous, viewing no file).
    `bytes_read` grows by the bytes of each block read, counted in the files' dtype.
    Unknown names raise `KeyError` naming the directory."""

    def __init__(
        self,
        model_dir: Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.device = torch.device(device)
        #: Where each tensor lives, its shape and its stored size in bytes (from the headers).
        self.files: dict[str, Path] = {}
        self.shapes: dict[str, list[int]] = {}
        self.nbytes: dict[str, int] = {}
        for path in safetensors_files(self.model_dir):
            for name, entry in _header(path).items():
                start, end = entry["data_offsets"]
                self.files[name], self.shapes[name], self.nbytes[name] = (
                    path,
                    entry["shape"],
                    end - start,
                )
        if not self.files:
            raise FileNotFoundError(f"{self.model_dir}: no safetensors weights")
        self._handles: dict[Path, Any] = {}
        #: Vocabulary shards read so far: a head tied to the embedding asks for them again.
        self._vocab: dict[tuple[str, int, int], torch.Tensor] = {}
        #: Bytes copied out of the files so far (the files' dtype).
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> list[int]:
        if name not in self.shapes:
            raise KeyError(f"{self.model_dir}: the checkpoint has no tensor {name!r}")
        return self.shapes[name]

    def read(self, name: str, rows: slice = slice(None), cols: slice | None = None) -> torch.Tensor:
        """`tensor[rows]`, or `tensor[rows, cols]`, read from the file, converted."""
        self.shape(name)  # the KeyError for an unknown name
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = _open(path)
        view = self._handles[path].get_slice(name)
        block = view[rows] if cols is None else view[rows, cols]
        self.bytes_read += block.numel() * block.element_size()
        out = block.to(dtype=self.dtype or block.dtype, device=self.device)
        if out.untyped_storage().nbytes() != out.nbytes or not out.is_contiguous():
            out = out.clone(memory_format=torch.contiguous_format)  # a view of a mapping
        return out

    def rows(self, name: str, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Rows `part*n .. (part+1)*n` of `parts` equal row blocks (n = rows / parts), as
        `tensor_parallel.shard_rows`; the whole tensor for one part."""
        n = self.shape(name)[0] // parts
        return self.read(name, slice(part * n, (part + 1) * n))

    def cols(self, name: str, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Columns `part*n .. (part+1)*n` of a 2-D tensor, as `tensor_parallel.shard_cols`."""
        if parts == 1:
            return self.read(name)
        n = self.shape(name)[1] // parts
        return self.read(name, slice(None), slice(part * n, (part + 1) * n))

    def vocab_rows(self, name: str, rank: int, size: int) -> torch.Tensor:
        """This rank's `ceil(V / size)` rows of an embedding or LM-head tensor `[V, ...]`,
        zero past the vocabulary, as `tensor_parallel.vocab_shard`. Asked again (a tied
        head), the same tensor, read once: callers copy, never write it."""
        key = (name, rank, size)
        if key not in self._vocab:
            self._vocab[key] = self._vocab_rows(name, rank, size)
        return self._vocab[key]

    def _vocab_rows(self, name: str, rank: int, size: int) -> torch.Tensor:
        vocab = self.shape(name)[0]
        per = math.ceil(vocab / size)
        start = min(rank * per, vocab)
        block = self.read(name, slice(start, min(start + per, vocab)))
        if block.shape[0] == per:
            return block
        shard = block.new_zeros((per, *block.shape[1:]))
        shard[: block.shape[0]] = block
        return shard

    def layer(self, prefix: str) -> CheckpointLayer:
        """The tensors under `prefix` (`"model.layers.3."`), by their names within it."""
        return CheckpointLayer(self, prefix)

    def close(self) -> int:
        """Let go of the open files and the kept vocabulary shards (the index stays);
        `bytes_read`, the bytes read in all."""
        self._handles.clear()
        self._vocab.clear()
        return self.bytes_read


class CheckpointLayer:
    """One module's tensors in the checkpoint by their names within it: the
    `fused_decoder.WeightSource` a fused layer is built from. Every read is new memory."""

    views = False

    def __init__(self, checkpoint: CheckpointShards, prefix: str) -> None:
        self.checkpoint = checkpoint
        self.prefix = prefix

    def has(self, name: str) -> bool:
        return self.checkpoint.has(self.prefix + name)

    def rows(self, name: str, part: int = 0, parts: int = 1) -> torch.Tensor:
        return self.checkpoint.rows(self.prefix + name, part, parts)

    def cols(self, name: str, part: int = 0, parts: int = 1) -> torch.Tensor:
        return self.checkpoint.cols(self.prefix + name, part, parts)


class WeightSource(Protocol):
    """Where `_take_layer` reads a layer's tensors, named as in the HF layer module
    (`"self_attn.q_proj.weight"`). `rows` / `cols` give block `part` of `parts` equal row /
    column blocks (the whole tensor by default); `has` says whether a tensor exists (biases,
    Qwen3's q/k norms). `views`: a whole tensor may be the HF parameter itself (a linear
    that keeps it plain copies it); else every read is new memory."""

    views: bool

    def has(self, name: str) -> bool: ...

    def rows(self, name: str, part: int = 0, parts: int = 1) -> torch.Tensor: ...

    def cols(self, name: str, part: int = 0, parts: int = 1) -> torch.Tensor: ...


class ModuleWeights:
    """The parameters of a loaded HF layer as a `WeightSource`: the whole tensor is the
    parameter itself, a block a new tensor (`tensor_parallel.shard_rows` / `shard_cols`)."""

    views = True

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def has(self, name: str) -> bool:
        owner, _, attr = name.rpartition(".")
        try:
            module = self.module.get_submodule(owner)
        except AttributeError:
            return False
        return isinstance(getattr(module, attr, None), torch.Tensor)

    def rows(self, name: str, part: int = 0, parts: int = 1) -> torch.Tensor:
        param = self.module.get_parameter(name)
        return param if parts == 1 else shard_rows(param, part, parts)

    def cols(self, name: str, part: int = 0, parts: int = 1) -> torch.Tensor:
        param = self.module.get_parameter(name)
        return param if parts == 1 else shard_cols(param, part, parts)
