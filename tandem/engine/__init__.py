"""The streaming engine client (`AsyncLLM`) and its engine-core processes."""

from tandem.engine.async_llm import AsyncLLM
from tandem.engine.errors import EngineDeadError, QueueFullError, StreamOverflowError

__all__ = ["AsyncLLM", "EngineDeadError", "QueueFullError", "StreamOverflowError"]
