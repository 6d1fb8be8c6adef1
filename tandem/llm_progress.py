"""`LLM.generate`'s progress bar (vLLM's): prompts processed and token rates.

`use_tqdm` is True (tqdm's bar), False, or a callable that makes a tqdm-like bar;
`_Progress` counts a prompt once, when its last sequence ends (n > 1), and shows the
estimated input and output token rates. The underscored names are the front door's own
(`tandem.llm`), not API.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tandem.output_processor import OutputProcessor

#: `use_tqdm`: True (tqdm's bar), False, or a callable that makes the bar (vLLM's shape,
#: e.g. `functools.partial(tqdm, leave=False)`).
ProgressOption = bool | Callable[..., Any]


class _Progress:
    """vLLM's progress bar: prompts processed (a prompt with n > 1 counts once, when its
    last sequence ends) and the estimated input and output token rates."""

    def __init__(
        self,
        use_tqdm: ProgressOption,
        groups: list[tuple[str, list[str]]],
        output_processor: OutputProcessor,
    ) -> None:
        if callable(use_tqdm):
            factory = use_tqdm
        else:
            from tqdm.auto import tqdm as factory
        self.records = output_processor.records
        self.group_of = {rid: gid for gid, children in groups for rid in children}
        self.remaining = {gid: len(children) for gid, children in groups}
        self.input_tokens = 0
        self.output_tokens = 0
        self.started = time.perf_counter()
        self.bar = factory(
            total=len(groups),
            desc="Processed prompts",
            dynamic_ncols=True,
            postfix=_speed(0.0, 0.0),
        )
        # Requests a plugin refused at add_request finished before the first step.
        self.finished([rid for rid, record in self.records.items() if record.finish_reason])

    def finished(self, request_ids: list[str]) -> None:
        done = 0
        for rid in request_ids:
            gid = self.group_of.pop(rid, None)
            if gid is None:
                continue
            record = self.records[rid]
            self.input_tokens += len(record.prompt_token_ids)
            self.output_tokens += len(record.token_ids)
            self.remaining[gid] -= 1
            done += self.remaining[gid] == 0
        if done:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            self.bar.postfix = _speed(self.input_tokens / elapsed, self.output_tokens / elapsed)
            self.bar.update(done)

    def failed(self) -> None:
        """The engine stopped: the bar keeps the prompts really processed (never 100 % for
        a run that failed) and says so in its description."""
        self.bar.desc = "Processed prompts (engine failed)"

    def close(self) -> None:
        self.bar.close()


def _speed(input_rate: float, output_rate: float) -> str:
    return f"est. speed input: {input_rate:.2f} toks/s, output: {output_rate:.2f} toks/s"
