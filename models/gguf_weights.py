"""A GGUF file's tensors under their Hugging Face names, the quantized ones kept quantized.

A `.gguf` model is converted once into an HF directory (`model_files.convert_gguf`: config,
tokenizer, float32 safetensors), which records the file it came from (`GGUF_SOURCE_FILE`).
With `model.quantization: auto` on the CPU the layers' and the LM head's weights of the
`GGUF_KEPT_TYPES` (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) are then read from the GGUF itself and
repacked into `QuantLinear`s (`quantized_weight.from_gguf_blocks`: integer codes copied,
scales and mins made exactly, no float round trip). Every other tensor (norms, weights of
other GGUF types) is read as float from the converted copy, and one log line names the
types that were dequantized.

Names: gguf's own tensor-name map (`gguf.get_tensor_name_map`) gives each HF parameter's
GGUF name. Llama's Q and K rows are stored permuted in GGUF (llama.cpp's rotary layout);
they are put back in HF order exactly as transformers' GGUF loader does, a permutation of
whole rows (codes, scales and mins alike), so the kept weights dequantize to the converted
copy's float32 weights bit for bit.

Tensor parallelism: a rank's row block (`rows`) is cut from the raw blocks before they are
unpacked (only its share is copied out of the file); a column block (`cols`, row-parallel
O and down) is cut from the unpacked weight on whole quantization groups, and a split that
would cut a group is refused naming the tensor and the group size.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from tandem.models.checkpoint_shards import CheckpointLayer, CheckpointShards
from tandem.models.gguf_index import GGUFIndex, GGUFTensor
from tandem.models.quantized_weight import GGUF_KEPT_TYPES, QuantizedWeight, from_gguf_blocks

logger = logging.getLogger("tandem.model")

#: In a converted directory: the absolute path of the GGUF it was converted from.
GGUF_SOURCE_FILE = "gguf_source.txt"
#: Architectures whose GGUF Q/K rows are permuted (transformers' LlamaTensorProcessor).
_PERMUTED_QK = ("llama",)


def record_gguf_source(model_dir: Path, gguf_path: Path) -> None:
    """Note in `model_dir` which GGUF it was converted from (rewritten atomically at every
    resolve: the same content may be installed at several paths)."""
    target = model_dir / GGUF_SOURCE_FILE
    text = str(gguf_path.resolve())
    try:
        if target.exists() and target.read_text() == text:
            return
        scratch = target.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(text)
        scratch.replace(target)
    except OSError as exc:  # a read-only cache: the model then runs dequantized
        logger.warning("cannot record the GGUF source in %s: %s", model_dir, exc)


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF a converted directory was made from, or None: not a converted directory,
    or that file is gone or now holds other content."""
    from tandem.models.model_files import gguf_cache_dir

    record = model_dir / GGUF_SOURCE_FILE
    if not record.exists():
        return None
    path = Path(record.read_text().strip())
    if not path.is_file() or gguf_cache_dir(path).resolve() != model_dir.resolve():
        return None
    return path


def _qk_row_order(rows: int, heads: int) -> torch.Tensor:
    """Row indices that undo GGUF's Q/K permutation for `heads` heads of `rows` rows."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


class GGUFShards:
    """`CheckpointShards`' interface (what the fused decoder and the LM head read) over a
    GGUF and its converted directory: `rows` / `cols` of a tensor of a kept type return a
    `QuantizedWeight` block, of anything else the float tensor from `floats`."""

    def __init__(self, path: Path, floats: CheckpointShards, hf_config: Any, names: list[str]):
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        self.path, self.floats, self.hf_config = path, floats, hf_config
        index = GGUFIndex(path)
        self._index: GGUFIndex | None = index
        self.arch = index.architecture()
        arch_id = {v: k for k, v in MODEL_ARCH_NAMES.items()}.get(self.arch)
        by_name = {t.name: t for t in index.tensors}
        name_map = get_tensor_name_map(arch_id, hf_config.num_hidden_layers) if arch_id else None
        self._tensors: dict[str, GGUFTensor] = {}
        dequantized: Counter[str] = Counter()
        kept: Counter[str] = Counter()
        for name in names:
            base, _, suffix = name.rpartition(".")
            gguf_base = name_map.get_name(base) if name_map is not None else None
            tensor = by_name.get(f"{gguf_base}.{suffix}") if gguf_base else None
            if tensor is None:
                continue
            kind = tensor.tensor_type.name
            if kind in GGUF_KEPT_TYPES and len(tensor.shape) == 2:
                self._tensors[name] = tensor
                kept[kind] += 1
            elif kind not in ("F32", "F16", "BF16"):
                dequantized[kind] += 1
        self.kept_types = dict(kept)
        if dequantized:
            logger.warning(
                "%s: GGUF types %s are not kept quantized (kept: %s): %d tensors of them "
                "run dequantized to float",
                path.name,
                sorted(dequantized),
                ", ".join(GGUF_KEPT_TYPES),
                sum(dequantized.values()),
            )
        #: Bytes of quantized blocks read from the GGUF so far.
        self.quantized_bytes_read = 0

    def is_quantized(self, name: str) -> bool:
        return name in self._tensors

    def quantized(self, name: str, part: int = 0, parts: int = 1) -> QuantizedWeight:
        """Row block `part` of `parts` (equal blocks, in HF row order) of the tensor `name`
        (HF name) as a `QuantizedWeight`; the whole tensor by default. Only the block's raw
        rows are copied out of the file and unpacked."""
        tensor = self._tensors[name]
        columns, rows = (int(d) for d in tensor.shape)  # GGUF lists the fastest dim first
        heads = self._permuted_heads(name)
        data = tensor.data
        if heads is not None or parts > 1:
            order = _qk_row_order(rows, heads) if heads is not None else torch.arange(rows)
            n = rows // parts
            data = data[order[part * n : (part + 1) * n].numpy()]
        self.quantized_bytes_read += int(data.nbytes)
        weight = from_gguf_blocks(tensor.tensor_type.name, data, (int(data.shape[0]), columns))
        if self._index is not None:  # copied out: the file's pages need not stay resident
            self._index.release(tensor)
        return weight

    def _permuted_heads(self, name: str) -> int | None:
        if self.arch not in _PERMUTED_QK:
            return None
        cfg = self.hf_config
        if name.endswith("q_proj.weight"):
            return cfg.num_attention_heads
        if name.endswith("k_proj.weight"):
            return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return None

    def has(self, name: str) -> bool:
        return name in self._tensors or self.floats.has(name)

    def rows(self, name: str, part: int = 0, parts: int = 1) -> Any:
        if name in self._tensors:
            return self.quantized(name, part, parts)
        return self.floats.rows(name, part, parts)

    def cols(self, name: str, part: int = 0, parts: int = 1) -> Any:
        """Column block `part` of `parts`; of a kept tensor only on whole quantization
        groups (ValueError naming the tensor, its type and group size otherwise)."""
        if name not in self._tensors:
            return self.floats.cols(name, part, parts)
        weight = self.quantized(name)
        try:
            return weight.col_block(part, parts)
        except ValueError as exc:
            raise ValueError(
                f"{name} (GGUF {weight.kind}, groups of {weight.group_size} inputs): {exc}; "
                "choose a tensor_parallel_size that splits it on whole groups"
            ) from None

    def vocab_rows(self, name: str, rank: int, size: int) -> torch.Tensor:
        """A vocabulary shard, as float (tensor-parallel embeddings and heads)."""
        return self.floats.vocab_rows(name, rank, size)

    def layer(self, prefix: str) -> CheckpointLayer:
        return CheckpointLayer(self, prefix)  # type: ignore[arg-type]

    def close(self) -> int:
        """Let go of the GGUF's mapping (every weight read was copied out) and of the float
        reader; bytes read in all: the quantized blocks plus the float tensors."""
        self._tensors.clear()
        self._index = None
        return self.quantized_bytes_read + self.floats.close()
