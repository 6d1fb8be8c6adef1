"""AWQ and GPTQ int4 checkpoints (transformers' format), kept quantized on the CPU.

Such a checkpoint's `config.json` carries `quantization_config` with `quant_method` `awq`
or `gptq`, and each quantized linear `<name>` holds `<name>.qweight`, `<name>.qzeros` and
`<name>.scales` (GPTQ: also `<name>.g_idx`) in place of `<name>.weight`. Both formats
define, for input i, output o and group g = g_idx(i) (`i // group_size`):

    w[o, i] = scale[g, o] * (q[i, o] - zero[g, o])

with int4 codes q, int4 zeros and float16 scales. tandem keeps the codes as they are and
writes the rest in the `QuantizedWeight` form `scale * q + min` with `min = -scale * zero`:
a float16 scale times an integer of at most 5 bits needs at most 16 significant bits, so
`scale * q`, `scale * zero` and their difference are all exact in float32. The layer's
weights are therefore exactly the format's dequantized values (a float16 kernel rounds
that product to float16; float32 arithmetic, as here, keeps it exact).

Packing, as the formats' writers lay it out (32-bit words, nibble j = bits 4j..4j+3):

- **AWQ (`version: gemm`):** `qweight [in, out / 8]` and `qzeros [groups, out / 8]` pack 8
  outputs per word in the interleaved order `AWQ_PACK_ORDER`: nibble j holds output
  `8c + AWQ_PACK_ORDER[j]`. `scales [groups, out]`. The zero is the stored nibble.
- **GPTQ:** `qweight [in / 8, out]` packs 8 consecutive inputs per word (nibble j: input
  `8r + j`); `qzeros [groups, out / 8]` packs 8 consecutive outputs per word. A v1
  checkpoint (`checkpoint_format: gptq`, the default) stores zero - 1, so its zero is the
  nibble + 1 (1..16); `gptq_v2` stores the zero itself. `g_idx [in]` names each input's
  group.

Refused, with the field named: bits other than 4; AWQ versions other than `gemm` (GEMV and
the others pack differently), `zero_point: false`, and the `llm-awq` packing; GPTQ
checkpoint formats other than `gptq` / `gptq_v2`, a quantized LM head (`lm_head: true`),
and `desc_act` whose `g_idx` is not `i // group_size` (act-order groups are scattered over
the inputs, which the group-wise layout cannot hold without permuting the activations);
group sizes that are not a multiple of 8 (whole 8-code words), or -1 for one group per row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.models.checkpoint_shards import CheckpointLayer, CheckpointShards
from tandem.models.quantized_weight import QuantizedWeight
from tandem.models.tensor_parallel import shard_cols
from tandem.schema.config import ConfigError

logger = logging.getLogger("tandem.model")

#: AWQ's order of outputs within a packed word: nibble j holds output `AWQ_PACK_ORDER[j]`.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: The nibble that holds output c of a word (the inverse of `AWQ_PACK_ORDER`).
_AWQ_NIBBLE_OF_OUTPUT = tuple(AWQ_PACK_ORDER.index(c) for c in range(8))
#: `quant_method` values loaded here.
PREQUANTIZED_METHODS = ("awq", "gptq")
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> the zero's stored offset


@dataclass(frozen=True)
class PrequantizedFormat:
    """A checkpoint's `quantization_config`, validated: `method` (`awq` / `gptq`),
    `group_size` (inputs per scale; -1: one group per row) and `zero_offset` (added to a
    stored zero nibble: 1 for GPTQ v1 checkpoints, else 0)."""

    method: str
    group_size: int
    zero_offset: int = 0

    @property
    def label(self) -> str:
        """`awq-int4-g128`, `gptq-int4-gall`: how logs and `Worker.describe` name it."""
        group = "all" if self.group_size == -1 else str(self.group_size)
        return f"{self.method}-int4-g{group}"


def _field(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` that `config` holds (AutoAWQ and transformers spell some
    fields differently: `w_bit` / `bits`, `q_group_size` / `group_size`)."""
    return next((config[n] for n in names if n in config), default)


def _refuse(field: str, got: Any, expected: str) -> ConfigError:
    return ConfigError(f"quantization_config.{field}: {expected}, got {got!r}")


def prequantized_format(hf_config: Any) -> PrequantizedFormat | None:
    """The AWQ / GPTQ format a transformers config declares (None: no
    `quantization_config`). `ConfigError` naming the field for a method or variant that
    is not loaded (see the module docstring)."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    config = raw if isinstance(raw, dict) else raw.to_dict()
    method = str(config.get("quant_method", "")).lower()
    if method not in PREQUANTIZED_METHODS:
        raise _refuse("quant_method", method, f"tandem loads {' / '.join(PREQUANTIZED_METHODS)}")
    bits = _field(config, "bits", "w_bit")
    if bits != 4:
        raise _refuse("bits", bits, f"tandem loads 4-bit {method.upper()} checkpoints")
    group = _field(config, "group_size", "q_group_size", default=-1 if method == "gptq" else None)
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 8 == 0)):
        raise _refuse("group_size", group, "a positive multiple of 8, or -1 (one group)")
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse("version", version, "tandem loads AWQ's gemm packing")
        if not config.get("zero_point", True):
            raise _refuse("zero_point", False, "tandem loads AWQ with zero points (true)")
        backend = str(config.get("backend", "autoawq")).lower()
        if backend != "autoawq":
            raise _refuse("backend", backend, "tandem loads AutoAWQ's packing (autoawq)")
        return PrequantizedFormat("awq", group)
    layout = str(_field(config, "checkpoint_format", "format", default="gptq")).lower()
    if layout not in _GPTQ_FORMATS:
        raise _refuse("checkpoint_format", layout, f"one of {sorted(_GPTQ_FORMATS)}")
    if config.get("lm_head", False):
        raise _refuse("lm_head", True, "tandem loads GPTQ with a float LM head (false)")
    return PrequantizedFormat("gptq", group, _GPTQ_FORMATS[layout])


def check_quantization_mode(hf_config: Any, mode: str) -> PrequantizedFormat | None:
    """The checkpoint's AWQ / GPTQ format, checked against `model.quantization` `mode`:
    `auto` and the checkpoint's own method keep it quantized, `none` dequantizes it; any
    other mode (re-quantizing, or the other method) is a `ConfigError` naming both. A
    float checkpoint with `mode` `awq` / `gptq` is refused the same way."""
    found = prequantized_format(hf_config)
    if found is None:
        if mode in PREQUANTIZED_METHODS:
            raise ConfigError(
                f"model.quantization: {mode} needs a checkpoint whose config.json has "
                f"quantization_config.quant_method: {mode}; this one has no quantization_config"
            )
        return None
    if mode not in ("auto", "none", found.method):
        raise ConfigError(
            f"model.quantization: {mode} conflicts with the checkpoint's "
            f"quantization_config.quant_method: {found.method} (use auto or {found.method} "
            "to run it quantized, or none to dequantize it)"
        )
    return found


def _nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> uint8 nibbles, 8 per word along `dim` (nibble j of word r at index
    8r + j): `[..., n, ...]` -> `[..., 8n, ...]`."""
    words = words.to(torch.int32)
    shape = list(words.shape)
    out = torch.empty([*shape[: dim + 1], 8, *shape[dim + 1 :]], dtype=torch.uint8)
    for j in range(8):  # an arithmetic shift, then the low 4 bits: the nibble, sign or not
        out.select(dim + 1, j).copy_((words >> (4 * j)) & 15)
    shape[dim] *= 8
    return out.view(shape)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name}: expected shape {list(expected)}, got {list(tensor.shape)}")


def _weight(
    codes_in_out: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int, kind: str
) -> QuantizedWeight:
    """`w[o, i] = scale[g, o] * (q[i, o] - zero[g, o])` as a `QuantizedWeight` `[out, in]`:
    codes q, scales, mins = -scale * zero (exact in float32, see the module docstring)."""
    scales32 = scales.float()
    mins = -(scales32 * zeros.float())
    return QuantizedWeight(
        codes_in_out.t().contiguous(),
        scales32.t().contiguous(),
        mins.t().contiguous(),
        4,
        group,
        kind,
    )


def awq_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    name: str = "",
) -> QuantizedWeight:
    """An AWQ gemm linear's `QuantizedWeight` `[out, in]` (shapes checked, naming `name`)."""
    inn, out = qweight.shape[0], qweight.shape[1] * 8
    group = inn if group_size == -1 else group_size
    groups = -(-inn // group)
    _check_shape(f"{name}.scales", scales, (groups, out))
    _check_shape(f"{name}.qzeros", qzeros, (groups, out // 8))
    order = list(_AWQ_NIBBLE_OF_OUTPUT)
    codes = _nibbles(qweight, 1).view(inn, out // 8, 8)[..., order].reshape(inn, out)
    zeros = _nibbles(qzeros, 1).view(groups, out // 8, 8)[..., order].reshape(groups, out)
    return _weight(codes, zeros, scales, group, f"awq-g{group}")


def gptq_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zero_offset: int,
    name: str = "",
) -> QuantizedWeight:
    """A GPTQ linear's `QuantizedWeight` `[out, in]`; `g_idx` (None: absent) must be
    `i // group_size` (ValueError naming `desc_act` otherwise)."""
    inn, out = qweight.shape[0] * 8, qweight.shape[1]
    group = inn if group_size == -1 else group_size
    groups = -(-inn // group)
    _check_shape(f"{name}.scales", scales, (groups, out))
    _check_shape(f"{name}.qzeros", qzeros, (groups, -(-out // 8)))
    if g_idx is not None:
        _check_shape(f"{name}.g_idx", g_idx, (inn,))
        if not torch.equal(g_idx.long(), torch.arange(inn) // group):
            raise ValueError(
                f"{name}.g_idx: quantization_config.desc_act (act-order) groups are scattered "
                f"over the inputs; tandem loads GPTQ whose input i is in group i // {group} "
                "(desc_act: false)"
            )
    codes = _nibbles(qweight, 0)
    zeros = _nibbles(qzeros, 1)[:, :out].to(torch.int16) + zero_offset
    return _weight(codes, zeros, scales, group, f"gptq-g{group}")


class PrequantizedShards:
    """`CheckpointShards`' interface (what the fused decoder and the LM head read) over an
    AWQ / GPTQ checkpoint: `rows` / `cols` of `<name>.weight`, where the files hold
    `<name>.qweight`, return a `QuantizedWeight` block (`keep`) or its dequantized values
    in `dtype` on `device` (not `keep`: `model.quantization: none`, or off the CPU); every
    other tensor is read as float (`floats`). A quantized LM head or embedding is refused
    (ValueError naming the tensor)."""

    views = False

    def __init__(
        self,
        model_dir: Path,
        found: PrequantizedFormat,
        dtype: torch.dtype | None,
        device: torch.device,
        keep: bool,
    ) -> None:
        self.found, self.keep = found, keep
        self.floats = CheckpointShards(model_dir, dtype, device)
        #: The packed tensors in the files' own dtypes (int32 words, float16 scales).
        self.packed = CheckpointShards(model_dir)
        suffix = ".qweight"
        self._quantized = {n[: -len(suffix)] for n in self.packed.files if n.endswith(suffix)}
        if not self._quantized:
            raise ValueError(
                f"{model_dir}: quantization_config.quant_method is {found.method} but no "
                f"tensor ends in {suffix}"
            )
        for base in self._quantized:
            if base.split(".")[-1] in ("lm_head", "embed_tokens"):
                raise ValueError(f"{base}.qweight: a quantized {base} is not loaded (layers only)")
        #: Which weights are quantized, as `HFStepModel.quantization` reports it.
        self.label = found.label if keep else f"none (dequantized {found.label})"

    def is_quantized(self, name: str) -> bool:
        return name.endswith(".weight") and name[: -len(".weight")] in self._quantized

    def has(self, name: str) -> bool:
        return self.is_quantized(name) or self.floats.has(name)

    def quantized(self, name: str) -> QuantizedWeight:
        """The whole `<base>.weight` as a `QuantizedWeight` `[out, in]`."""
        base = name[: -len(".weight")]
        qweight, qzeros, scales = (
            self.packed.read(f"{base}.{t}") for t in ("qweight", "qzeros", "scales")
        )
        if self.found.method == "awq":
            return awq_weight(qweight, qzeros, scales, self.found.group_size, base)
        g_idx = self.packed.read(f"{base}.g_idx") if self.packed.has(f"{base}.g_idx") else None
        return gptq_weight(
            qweight, qzeros, scales, g_idx, self.found.group_size, self.found.zero_offset, base
        )

    def _dense(self, weight: QuantizedWeight) -> torch.Tensor:
        return weight.dequantize().to(
            dtype=self.floats.dtype or torch.float32, device=self.floats.device
        )

    def rows(self, name: str, part: int = 0, parts: int = 1) -> Any:
        if not self.is_quantized(name):
            return self.floats.rows(name, part, parts)
        if self.keep:
            return self.quantized(name).row_block(part, parts)
        return self._dense(self.quantized(name).row_block(part, parts))

    def cols(self, name: str, part: int = 0, parts: int = 1) -> Any:
        if not self.is_quantized(name):
            return self.floats.cols(name, part, parts)
        if self.keep:
            return self.quantized(name).col_block(part, parts)
        dense = self._dense(self.quantized(name))
        return shard_cols(dense, part, parts).contiguous() if parts > 1 else dense

    def vocab_rows(self, name: str, rank: int, size: int) -> torch.Tensor:
        return self.floats.vocab_rows(name, rank, size)

    def layer(self, prefix: str) -> CheckpointLayer:
        return CheckpointLayer(self, prefix)  # type: ignore[arg-type]

    def close(self) -> int:
        """Let go of both readers; the bytes read in all (packed tensors and floats)."""
        return self.packed.close() + self.floats.close()


def prequantized_shards(
    model_dir: Path, hf_config: Any, mode: str, dtype: torch.dtype | None, device: torch.device
) -> PrequantizedShards | None:
    """The reader of an AWQ / GPTQ checkpoint (None: its config has no
    `quantization_config`) under `model.quantization` `mode` (`check_quantization_mode`):
    kept quantized on the CPU unless `mode` is `none`; off the CPU, dequantized."""
    found = check_quantization_mode(hf_config, mode)
    if found is None:
        return None
    keep = mode != "none" and device.type == "cpu"
    shards = PrequantizedShards(model_dir, found, dtype, device, keep)
    logger.info(
        "%s: %s checkpoint, %s",
        model_dir.name,
        found.label,
        "kept quantized" if keep else "dequantized",
    )
    return shards
