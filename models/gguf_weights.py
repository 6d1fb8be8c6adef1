"""A GGUF file's tensors under their Hugging Face names, the quantized ones kept quantized.

A `.gguf` model is converted once into an HF directory (`model_files.convert_gguf`: config,
tokenizer, float32 safetensors), which records the file it came from (`GGUF_SOURCE_FILE`).
With `model.quantization: auto` on the CPU the layers' and the LM head's weights of the
`GGUF_KEPT_TYPES` (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) are then read from the GGUF itself and
repacked into `QuantLinear`s (`quantized_weight.from_gguf_blocks`: integer codes copied,
scales and mins made exactly, no float round trip). Every other tensor (norms, weights of
other GGUF types) is read as float from the converted copy, and one log line names the
types that were dequantized.

Names: `gguf_name_map` gives each HF parameter's GGUF name (a table for the Llama family,
gguf's own `get_tensor_name_map` for other architectures). Llama's Q and K rows are stored
permuted in GGUF (llama.cpp's rotary layout); they are put back in HF order exactly as
transformers' GGUF loader does, a permutation of whole rows (codes, scales and mins
alike), so the kept weights dequantize to the converted copy's float32 weights bit for bit.

Tensor parallelism: a rank's row block (`rows`) is cut from the raw blocks before they are
unpacked (only its share is copied out of the file); a column block (`cols`, row-parallel
O and down) is cut from the unpacked weight on whole quantization groups, and a split that
would cut a group is refused naming the tensor and the group size.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
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


#: GGUF names of the Llama-family modules (HF module path -> GGUF tensor base name), as
#: gguf's `get_tensor_name_map` gives them for these architectures. Read from this table,
#: loading imports no gguf: its package pulls in sentencepiece and numpy's typing (about
#: 2.7 MB of resident memory). `tests/model/test_gguf_name_map.py` holds it to gguf's map.
LLAMA_FAMILY_ARCHS = ("llama", "qwen2", "qwen3")
_MODEL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
#: Qwen3's per-head Q/K norms.
_QK_NORM_NAMES = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_name_map(arch: str, num_layers: int) -> Callable[[str], str | None]:
    """HF module path -> GGUF tensor base name (None where the file has no such tensor)
    for architecture `arch` with `num_layers` layers: the table above for the Llama
    family, gguf's own map for any other architecture gguf knows, else nothing."""
    if arch in LLAMA_FAMILY_ARCHS:
        layer_names = {**_LAYER_NAMES, **(_QK_NORM_NAMES if arch == "qwen3" else {})}

        def llama_family(base: str) -> str | None:
            if base in _MODEL_NAMES:
                return _MODEL_NAMES[base]
            prefix, _, rest = base.partition(".layers.")
            layer, _, module = rest.partition(".")
            if prefix != "model" or not layer.isdigit() or str(int(layer)) != layer:
                return None
            if int(layer) >= num_layers:
                return None
            suffix = layer_names.get(module)
            return f"blk.{int(layer)}.{suffix}" if suffix else None

        return llama_family
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = {v: k for k, v in MODEL_ARCH_NAMES.items()}.get(arch)
    if arch_id is None:
        return lambda base: None
    return get_tensor_name_map(arch_id, num_layers).get_name


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
    `QuantizedWeight` block; a Llama-family file's one-dimensional F32 / F16 tensors (norms,
    biases; not Llama's permuted Q/K biases) are read from the GGUF too, converted as the
    converted copy holds them (to float32, then `floats.dtype`), so a model whose matrices
    are all kept never opens the converted copy's safetensors; anything else is the float
    tensor from `floats`."""

    def __init__(self, path: Path, floats: CheckpointShards, hf_config: Any, names: list[str]):
        self.path, self.floats, self.hf_config = path, floats, hf_config
        index = GGUFIndex(path)
        self._index: GGUFIndex | None = index
        self.arch = index.architecture()
        by_name = {t.name: t for t in index.tensors}
        gguf_name = gguf_name_map(self.arch, hf_config.num_hidden_layers)
        self._tensors: dict[str, GGUFTensor] = {}
        self._plain: dict[str, GGUFTensor] = {}
        dequantized: Counter[str] = Counter()
        kept: Counter[str] = Counter()
        for name in names:
            base, _, suffix = name.rpartition(".")
            gguf_base = gguf_name(base)
            tensor = by_name.get(f"{gguf_base}.{suffix}") if gguf_base else None
            if tensor is None:
                continue
            kind = tensor.tensor_type.name
            if kind in GGUF_KEPT_TYPES and len(tensor.shape) == 2:
                self._tensors[name] = tensor
                kept[kind] += 1
            elif kind in ("F32", "F16") and len(tensor.shape) == 1 and self._plain_exact(name):
                self._plain[name] = tensor
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
            self._index.drop_resident_pages()
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

    def _plain_exact(self, name: str) -> bool:
        """Whether the GGUF's own values of plain tensor `name` are the converted copy's:
        a Llama-family file, and not a Q/K tensor that the conversion permutes."""
        if self.arch not in LLAMA_FAMILY_ARCHS:
            return False
        permuted = self.arch in _PERMUTED_QK and (".q_proj." in name or ".k_proj." in name)
        return not permuted

    def is_plain(self, name: str) -> bool:
        """Whether `name` is read as float from the GGUF itself (see the class docstring)."""
        return name in self._plain

    def plain_rows(self, name: str, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Row block `part` of `parts` of the plain tensor `name`, as float."""
        tensor = self._plain[name]
        n = int(tensor.shape[0]) // parts
        values = torch.from_numpy(tensor.data[part * n : (part + 1) * n].copy())
        return values.to(torch.float32).to(
            dtype=self.floats.dtype or torch.float32, device=self.floats.device
        )

    def float_reader(self) -> GGUFFloats:
        """Float tensors only (never a `QuantizedWeight`): the plain ones from the GGUF,
        the rest from `floats`. What the modules kept as they are read."""
        return GGUFFloats(self)

    def has(self, name: str) -> bool:
        return name in self._tensors or name in self._plain or self.floats.has(name)

    def rows(self, name: str, part: int = 0, parts: int = 1) -> Any:
        if name in self._tensors:
            return self.quantized(name, part, parts)
        if name in self._plain:
            return self.plain_rows(name, part, parts)
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
        self._plain.clear()
        self._index = None
        return self.quantized_bytes_read + self.floats.close()


class GGUFFloats:
    """`GGUFShards.float_reader()`: `rows` of any tensor as float, the GGUF's plain ones
    read from it, everything else (kept types included) from the converted copy."""

    def __init__(self, shards: GGUFShards) -> None:
        self.shards = shards

    def rows(self, name: str, part: int = 0, parts: int = 1) -> torch.Tensor:
        if self.shards.is_plain(name):
            return self.shards.plain_rows(name, part, parts)
        return self.shards.floats.rows(name, part, parts)
