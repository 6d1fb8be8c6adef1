"""One copy of every weight: the HF modules give up the parameters tandem's own path replaced.

The fused decoder and the LM head build their own weights (fused Q/K/V and gate/up, oneDNN
packed copies). `release_parameters` then replaces the HF modules' own parameters with meta
tensors of the same shape and dtype (no memory; calling such a module raises instead of
computing with stale weights), and `own_remaining_parameters` copies what the model still
uses (the embedding, tied or not, norms, anything not replaced) into memory the process
owns: transformers loads a float32 safetensors checkpoint as views of one private file
mapping, and as long as a single tensor views it the whole mapping, every page read while
packing, stays resident.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tandem.core.worker.host_heap import glibc_function


def _meta_parameter(param: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(
        torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False
    )


def release_parameters(modules: Iterable[torch.nn.Module]) -> None:
    """Replace every parameter that each of `modules` holds directly with a meta tensor."""
    for module in modules:
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, _meta_parameter(param))


def own_remaining_parameters(model: torch.nn.Module) -> None:
    """Give each CPU parameter and buffer of `model` still holding memory its own storage.

    A parameter is changed in place (`.data`), so tied parameters (one `Parameter` object in
    two modules, e.g. an LM head tied to the embedding) stay tied. Tensors on other devices
    and meta tensors are left alone.
    """
    with torch.no_grad():
        for param in model.parameters():
            if param.device.type == "cpu":
                param.data = param.data.clone()
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf is not None and buf.device.type == "cpu":
                    setattr(module, name, buf.clone())


def return_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS (glibc's `malloc_trim`; nothing elsewhere).

    Building quantized layers reads, converts and drops float tensors layer by layer; glibc
    keeps much of that freed memory in its heap (its mmap threshold grows after large frees),
    so a process that never holds the float model whole would still show its size as
    resident. Called after each layer and each quantized linear is built, and after the
    tokenizer loads."""
    trim = glibc_function("malloc_trim")
    if trim is not None:
        trim(0)
