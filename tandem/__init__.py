"""tandem: a plugin-architected LLM inference engine.

from tandem import LLM, SamplingParams
llm = LLM(model="scripted")
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.llm import LLM
    from tandem.schema.config import EngineConfig
    from tandem.schema.outputs import CompletionOutput, RequestOutput
    from tandem.schema.sampling_params import SamplingParams
    from tandem.stack_file import load_config

#: Public name -> defining module. Imported on first use (PEP 562), so `import tandem` and
#: the CLI's parser stay light: torch and transformers load when a model does.
_LAZY = {
    "LLM": "tandem.llm",
    "CompletionOutput": "tandem.schema.outputs",
    "EngineConfig": "tandem.schema.config",
    "RequestOutput": "tandem.schema.outputs",
    "SamplingParams": "tandem.schema.sampling_params",
    "load_config": "tandem.stack_file",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "load_config",
]
__version__ = "0.1.0"
