"""tandem: a plugin-architected LLM inference engine.

from tandem import LLM, SamplingParams
llm = LLM(model="scripted")
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8))
"""

from tandem.core.config import EngineConfig, load_config
from tandem.core.outputs import CompletionOutput, RequestOutput
from tandem.core.sampling_params import SamplingParams
from tandem.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "load_config",
]
__version__ = "0.1.0"
