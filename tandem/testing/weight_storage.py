"""Bytes of the distinct tensor storages a step model keeps alive (weights, not KV).

`reachable_weight_bytes(obj)` walks an object graph (attributes, slots, lists, tuples,
dicts, `nn.Module` parameters and buffers) and sums each distinct storage once: plain
tensors by their storage's data pointer (views and tied parameters count once), opaque
oneDNN tensors (`layout == torch._mkldnn`, e.g. prepacked linear weights, which have no
accessible storage) by identity at `numel * element_size` (their blocked layout may pad a
little more). Meta tensors hold no memory and count zero. Attributes named in `skip`
(by default the paged KV pools, `kv_caches`) are not walked.

`parameter_bytes(module)` is the reference: the bytes of the module's parameters as loaded,
tied parameters counted once.
"""

from __future__ import annotations

from typing import Any

import torch

DEFAULT_SKIP = frozenset({"kv_caches", "last_hidden_states"})


class _Counter:
    def __init__(self, skip: frozenset[str]) -> None:
        self.skip = skip
        self.seen_objects: set[int] = set()
        self.storages: dict[tuple[str, int], int] = {}

    def tensor(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        if t.layout == torch._mkldnn:
            self.storages[("opaque", id(t))] = t.numel() * t.element_size()
            return
        storage = t.untyped_storage()
        if storage.nbytes():
            self.storages[("plain", storage.data_ptr())] = storage.nbytes()

    def walk(self, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            self.tensor(obj)
            return
        if obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype)):
            return
        if id(obj) in self.seen_objects:
            return
        self.seen_objects.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                self.tensor(t)
            return
        if isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                self.walk(item)
            return
        if isinstance(obj, dict):
            for item in obj.values():
                self.walk(item)
            return
        self._walk_attributes(obj)

    def _walk_attributes(self, obj: Any) -> None:
        names = list(getattr(obj, "__dict__", {}))
        for cls in type(obj).__mro__:
            names.extend(getattr(cls, "__slots__", ()))
        for name in names:
            if name in self.skip or name.startswith("__"):
                continue
            try:
                value = getattr(obj, name)
            except AttributeError:
                continue
            self.walk(value)


def reachable_storages(obj: Any, skip: frozenset[str] = DEFAULT_SKIP) -> dict[tuple[str, int], int]:
    """Each distinct storage reachable from `obj`: `("plain", data_ptr)` or
    `("opaque", id(tensor))` -> its bytes (see the module doc)."""
    counter = _Counter(skip)
    counter.walk(obj)
    return counter.storages


def reachable_weight_bytes(obj: Any, skip: frozenset[str] = DEFAULT_SKIP) -> int:
    """Total bytes of the distinct storages reachable from `obj` (see the module doc)."""
    return sum(reachable_storages(obj, skip).values())


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters, each distinct storage once (tied weights once)."""
    counter = _Counter(frozenset())
    for p in module.parameters():
        counter.tensor(p)
    return sum(counter.storages.values())
