"""Model loaders: which loader claims a model, what it declares, and the HF/GGUF loader.

A loader is a class found through the entry-point group `tandem.model_loaders`. It declares,
as class attributes read without an instance:

- `model_kinds`: the kinds it loads. A config's `model.model` that equals a declared kind
  (e.g. `scripted`, the test model's loader in `tandem.testing`) is that kind; anything
  else (a directory, a `.gguf` file, a hub id, `default`) goes to the first loader, in
  kind order, whose optional `claims(path)` class method is true for it (DiffusionGemma
  claims directories whose `config.json` says `model_type: diffusion_gemma`), else it is
  the kind `hf`. A loader without `claims` claims nothing by path.
- `has_tokenizer`: the model comes with a tokenizer (and a generation config) in the
  directory `model.model` resolves to, so text prompts and grammars work.
- `simulatable`: its forward costs next to nothing, so the simulated executor may model the
  device's time on top of it.

and two class methods: `resolve_limits(config)` fills `vocab_size`, `eos_token_id`,
`max_model_len` (and may size `num_kv_blocks`) from the model, before the stack resolves;
`load(config)` builds the `StepModel` with a paged cache of `cache.num_kv_blocks`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from tandem.schema.config import ConfigError, EngineConfig

if TYPE_CHECKING:
    from tandem.core.worker.model_runner import StepModel

logger = logging.getLogger("tandem.config")

MODEL_LOADER_GROUP = "tandem.model_loaders"
#: The kind of every model no loader claims by name: HF directories, GGUF files, hub ids.
HF_KIND = "hf"


class ModelLoader(Protocol):
    model_kinds: ClassVar[tuple[str, ...]]
    has_tokenizer: ClassVar[bool]
    simulatable: ClassVar[bool]

    @classmethod
    def resolve_limits(cls, config: EngineConfig) -> None: ...

    @classmethod
    def load(cls, config: EngineConfig) -> StepModel: ...


def model_loaders() -> dict[str, type[ModelLoader]]:
    """Every installed loader, by each kind it declares."""
    from tandem.core.entry_points import plugin_entry_points

    loaders: dict[str, type[ModelLoader]] = {}
    for ep in plugin_entry_points(MODEL_LOADER_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:  # one broken loader must not hide the others
            logger.warning("model loader %r (%s) failed to import: %s", ep.name, ep.value, exc)
            continue
        for kind in cls.model_kinds:
            loaders.setdefault(kind, cls)
    return loaders


def _claiming_loader(model: str, loaders: dict[str, type[ModelLoader]]) -> type[ModelLoader] | None:
    """The first loader, in kind order, whose `claims(Path(model))` is true, else None."""
    path = Path(model)
    for _, cls in sorted(loaders.items()):
        claims = getattr(cls, "claims", None)
        try:
            if claims is not None and claims(path):
                return cls
        except Exception as exc:  # one broken loader must not hide the others
            logger.warning("model loader %s: claims(%r) failed: %s", cls.__name__, model, exc)
    return None


def model_loader_for(model: str) -> type[ModelLoader]:
    """The loader that claims `model`: by kind, then by `claims`, then `hf` (module
    docstring)."""
    loaders = model_loaders()
    loader = loaders.get(model) or _claiming_loader(model, loaders) or loaders.get(HF_KIND)
    if loader is None:
        raise ConfigError(
            f"model.model: no installed model loader claims {model!r} (entry-point group "
            f"{MODEL_LOADER_GROUP!r}; kinds: {', '.join(sorted(loaders)) or 'none'})"
        )
    return loader


def load_step_model(config: EngineConfig) -> StepModel:
    """Build the model for `config.model.model` with a paged cache of `cache.num_kv_blocks`."""
    if config.cache.num_kv_blocks is None:
        raise ConfigError("cache.num_kv_blocks must be resolved before the model is loaded")
    return model_loader_for(config.model.model).load(config)
