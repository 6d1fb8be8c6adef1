"""`LLM.generate`'s arguments as the engine takes them, each checked where it is given.

Prompts (one or a list; text, token ids or a dict), token ids as Python ints (floats,
bools and out-of-range values refused, never truncated), one priority per prompt, and a
`SamplingParams` from a dict of its fields. Each function raises ValueError naming the
argument (`prompts[2]`, `priority`, `sampling_params[1].temperature`). The underscored
names are the front door's own (`tandem.llm`), not API.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from typing import Any

import numpy as np

from tandem.schema.sampling_params import SamplingParams, SamplingParamsError

PromptType = str | Sequence[int] | dict[str, Any]


def _prompt_list(prompts: Any) -> list[Any]:
    """The prompts as a list: one string, dict or token-id list becomes a list of one."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise ValueError(
            "prompts: expected a string, a list of token ids, a dict with 'prompt' or "
            f"'prompt_token_ids', or a list of these, got {type(prompts).__name__}"
        )
    if not prompts:
        raise ValueError("prompts: expected at least one prompt, got an empty list")
    if isinstance(prompts[0], Real):  # one prompt of token ids (floats are refused there)
        return [prompts]
    return list(prompts)


def _token_ids(value: Any, where: str) -> list[int]:
    """A prompt's token ids as Python ints; floats, bools and anything else are refused
    (never truncated)."""
    if isinstance(value, (str, bytes, Mapping)) or value is None:
        raise ValueError(f"{where}: expected a list of integer token ids, got {value!r}")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{where}: expected a list of integer token ids ({exc})") from exc
    if array.ndim != 1:
        raise ValueError(
            f"{where}: expected a flat list of integer token ids, got {array.ndim} dimensions"
        )
    if array.size == 0:
        raise ValueError(f"{where}: the prompt is empty (no token ids)")
    if array.dtype.kind not in "iu":
        found = next(
            (
                (i, t)
                for i, t in enumerate(value.tolist() if hasattr(value, "tolist") else value)
                if isinstance(t, bool) or not isinstance(t, Integral)
            ),
            None,
        )
        if found is None:  # integers too large for int64
            raise ValueError(f"{where}: token id {max(array.tolist())} is out of range")
        raise ValueError(
            f"{where}: token ids must be integers, got {found[1]!r} "
            f"({type(found[1]).__name__}) at position {found[0]}"
        )
    return array.tolist()


def _priorities(priority: Any, num_prompts: int) -> list[int]:
    """One integer per prompt (all 0 when None)."""
    if priority is None:
        return [0] * num_prompts
    if isinstance(priority, (str, bytes, Mapping)) or not isinstance(priority, Sequence):
        raise ValueError(f"priority: expected a list of integers, one per prompt, got {priority!r}")
    if len(priority) != num_prompts:
        raise ValueError(
            f"priority: got {len(priority)} values for {num_prompts} prompts; give one per prompt"
        )
    for i, p in enumerate(priority):
        if isinstance(p, bool) or not isinstance(p, Integral):
            raise ValueError(f"priority[{i}]: expected an integer, got {p!r}")
    return [int(p) for p in priority]


def _as_sampling_params(value: Any, where: str) -> SamplingParams:
    """A `SamplingParams` as given, or a dict of its fields validated into one."""
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, Mapping):
        try:
            return SamplingParams(**{str(k): v for k, v in value.items()})
        except ValueError as exc:  # SamplingParamsError: one line per bad field
            message = str(exc).replace("SamplingParams:", f"{where}:")
            raise SamplingParamsError(message) from None
    raise ValueError(
        f"{where}: expected SamplingParams or a dict of its fields, got {type(value).__name__}"
    )
