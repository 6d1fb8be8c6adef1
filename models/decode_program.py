"""A decoder forward for all-decode steps in one compiled call (`csrc/decode_program.cpp`).

At batch 1 the decoder's Python loop makes about 270 kernel calls a token (for a 30-layer
model), each a few microseconds of ctypes arguments, tensor views and allocations: 2-3 ms
around 5-6 ms of memory-bound linears on a 2-core CPU. `DecodeProgram` hands the same
kernels' addresses and the layers' weights to one C function that makes the same calls in
the same order, so its hidden states are bit-identical to the Python loop's.

It runs a step when (checked per step; otherwise the Python loop runs):
- every query token is a decode (`PagedAttentionMetadata.decode_batch.all_tokens`; with the
  CPU decode kernel that includes prefill chunks of short contexts,
  `paged_attention.MAX_CONTEXT_AS_KERNEL_DECODES`);
- the activations are float32 on the CPU and both KV pools of every layer are float32
  contiguous (the decode kernel's layout);
and it exists for a decoder (checked once, `DecodeProgram.build`) whose linears all run on
the compiled kernels (`QuantLinear` codes, `F32PanelLinear` / `Bf16Linear` panels), with no
per-head q/k norms, one tensor-parallel rank and no pipeline link, and whose kernels all
load. `TANDEM_DECODE_PROGRAM=0` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import TYPE_CHECKING, Any

import torch

from tandem.models.cpu_kernels import load_library, paged_decode_kernel
from tandem.models.fused_ops import fused_ops
from tandem.models.paged_attention import PagedAttentionMetadata
from tandem.models.panel_linear import Bf16Linear, F32PanelLinear, panel_gemm_kernel
from tandem.models.quant_linear import QuantLinear

if TYPE_CHECKING:
    from tandem.models.fused_decoder import FusedDecoder

DECODE_PROGRAM_ABI = 1
#: Fields of one linear in the layer table (`csrc/decode_program.cpp`'s `Linear`).
LINEAR_FIELDS = 10
#: Fields of one layer: four linears, then ln_in, ln_post, key pool, value pool.
LAYER_FIELDS = 4 * LINEAR_FIELDS + 4
_QUANT, _F32_PANEL, _BF16_PANEL = 0, 1, 2


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = load_library(
        "decode_program.cpp",
        "tandem_decode_program_abi_version",
        DECODE_PROGRAM_ABI,
        "the Python decoder loop",
    )
    if library is None:
        return None
    fn = library.tandem_decode_program_run
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_float] * 2
    fn.restype = None
    return library


def _address(fn: Any) -> int:
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


def _kernel_table() -> torch.Tensor | None:
    """The kernels' addresses in the driver's `Kernels` order, or None if one is missing."""
    panel, ops, attention = panel_gemm_kernel(), fused_ops(), paged_decode_kernel()
    if panel is None or ops is None or attention is None:
        return None
    lib = ops.library
    functions = (
        panel.q_gemm,
        panel.f32_gemm,
        panel.bf16_gemm,
        lib.tandem_rms_norm_f32,
        lib.tandem_add_rms_norm_f32,
        lib.tandem_rope_f32,
        lib.tandem_silu_mul_f32,
        attention.write_function,
        attention.function,
    )
    return torch.tensor([_address(f) for f in functions], dtype=torch.int64)


def _ptr(tensor: torch.Tensor | None) -> int:
    return tensor.data_ptr() if tensor is not None else 0


def _linear_fields(linear: object) -> list[int] | None:
    """The driver's fields for one linear, or None when it does not run on a kernel."""
    if isinstance(linear, QuantLinear) and linear.weight is None and linear.codes is not None:
        return [
            _QUANT,
            _ptr(linear.codes),
            _ptr(linear.scales),
            _ptr(linear.mins),
            _ptr(linear.bias),
            linear.out_features,
            linear.in_features,
            linear.group_size,
            linear.bits,
            int(linear.half_scales),
        ]
    if isinstance(linear, F32PanelLinear | Bf16Linear) and linear.packed is not None:
        kind = _F32_PANEL if isinstance(linear, F32PanelLinear) else _BF16_PANEL
        fields = [kind, _ptr(linear.packed), 0, 0, _ptr(linear.bias)]
        return fields + [linear.out_features, linear.in_features, 0, 0, 0]
    return None


def _float32_vector(tensor: torch.Tensor, size: int) -> bool:
    return (
        tensor.dtype == torch.float32
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.numel() == size
    )


class DecodeProgram:
    """The compiled decode forward of one `FusedDecoder` (see the module docstring).

    Holds the decoder (its layers own every weight the table points at) and the layer
    table; the KV pool columns are refreshed from each step's metadata."""

    def __init__(self, decoder: FusedDecoder, kernels: torch.Tensor, table: torch.Tensor) -> None:
        self.decoder = decoder
        self.kernels = kernels
        self.table = table
        self._pools: tuple[int, ...] = ()
        self._run = _library().tandem_decode_program_run  # type: ignore[union-attr]

    @classmethod
    def build(cls, decoder: FusedDecoder) -> DecodeProgram | None:
        """The program for `decoder`, or None when it cannot run it (module docstring)."""
        if os.environ.get("TANDEM_DECODE_PROGRAM", "1") == "0":
            return None
        if decoder.link is not None or decoder.tp_size != 1:
            return None
        if decoder.hidden_dtype != torch.float32 or not decoder.layers:
            return None
        if _library() is None or (kernels := _kernel_table()) is None:
            return None
        hidden = decoder.hidden_size
        if not _float32_vector(decoder.norm_weight, hidden):
            return None
        rows = []
        inter = decoder.layers[0].down.in_features
        for layer in decoder.layers:
            if layer.down.in_features != inter or layer.gate_up.out_features != 2 * inter:
                return None
            if layer.q_norm is not None or layer.k_norm is not None:
                return None
            fields = [
                _linear_fields(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
            ]
            norms = (layer.ln_in, layer.ln_post)
            if any(f is None for f in fields) or not all(_float32_vector(n, hidden) for n in norms):
                return None
            row = [v for f in fields for v in f]  # type: ignore[union-attr]
            rows.append(row + [layer.ln_in.data_ptr(), layer.ln_post.data_ptr(), 0, 0])
        table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), LAYER_FIELDS)
        return cls(decoder, kernels, table.contiguous())

    def _set_pools(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Point the table at `kv_caches`; False when a pool is not the kernel's float32."""
        pools = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if pools == self._pools:
            return True
        if len(kv_caches) != len(self.decoder.layers):
            return False
        for k_pool, v_pool in kv_caches:
            for pool in (k_pool, v_pool):
                if pool.dtype != torch.float32 or not pool.is_contiguous():
                    return False
        self.table[:, -2] = torch.tensor(pools[0::2], dtype=torch.int64)
        self.table[:, -1] = torch.tensor(pools[1::2], dtype=torch.int64)
        self._pools = pools
        return True

    def run(
        self,
        h: torch.Tensor,
        rope_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor | None:
        """The final-normed hidden states `[rows, hidden]` of an all-decode step (the
        residual stream `h`, float32 `[rows, hidden]`, is updated in place); None, with
        nothing done, when the step is not one the program runs."""
        batch = meta.decode_batch
        if batch is None or not batch.all_tokens or meta.prefills or meta.decode_groups:
            return None
        if h.dtype != torch.float32 or h.device.type != "cpu" or not h.is_contiguous():
            return None
        cos, sin, index = rope_rows
        if cos.dtype != torch.float32 or index.dtype != torch.int64:
            return None
        if meta.slot_mapping.dtype != torch.int64 or not self._set_pools(meta.kv_caches):
            return None
        d = self.decoder
        rows = h.shape[0]
        block_size = meta.kv_caches[0][0].shape[-1]
        x = torch.empty_like(h)
        width = d.q_size + 2 * d.kv_size
        inter = d.layers[0].down.in_features
        scratch = [torch.empty(rows, w) for w in (width, d.q_size, d.q_size, d.hidden_size)]
        scratch += [torch.empty(rows, 2 * inter), torch.empty(rows, inter)]
        tensors = (h, x, d.norm_weight, index.contiguous(), cos.contiguous(), sin.contiguous())
        tensors += (meta.slot_mapping.contiguous(), batch.block_tables, batch.seq_lens)
        step = torch.tensor([t.data_ptr() for t in (*tensors, *scratch)], dtype=torch.int64)
        shape = torch.tensor(
            [
                len(d.layers),
                d.hidden_size,
                d.num_heads,
                d.num_kv_heads,
                d.head_dim,
                cos.shape[1],
                block_size,
                batch.block_tables.shape[1],
                rows,
                torch.get_num_threads(),
            ],
            dtype=torch.int64,
        )
        self._run(
            self.kernels.data_ptr(),
            self.table.data_ptr(),
            shape.data_ptr(),
            step.data_ptr(),
            d.eps,
            d.scaling,
        )
        return x
