"""Turning per-step `EngineCoreOutput`s into the client's `RequestOutput`s."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tandem.core.detokenizer import IncrementalDetokenizer
from tandem.core.outputs import CompletionOutput, EngineCoreOutput, RequestMetrics, RequestOutput
from tandem.core.sampling_params import SamplingParams


@dataclass(slots=True)
class _RequestRecord:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    logprobs: list[dict[int, tuple[float, int]]] | None = None


class OutputProcessor:
    """Accumulates each request's tokens in order and stamps its metrics.

    Invariant: tokens are appended exactly once, in the order the engine produced them;
    a finished request accepts nothing more.
    """

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.records: dict[str, _RequestRecord] = {}
        #: Requests a stop string finished: the engine must abort them.
        self.stopped_by_string: list[str] = []

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        arrival_time: float,
        params: SamplingParams | None = None,
    ) -> None:
        record = _RequestRecord(
            request_id, prompt, list(prompt_token_ids), RequestMetrics(arrival_time)
        )
        if self.tokenizer is not None and params is not None:
            record.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                params.stop,
                params.include_stop_str_in_output,
                params.min_tokens,
                params.skip_special_tokens,
            )
        if params is not None and params.logprobs is not None:
            record.logprobs = []
        self.records[request_id] = record

    def process(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Apply one step's outputs; return the ids that finished in it. Requests ended by
        a stop string finish here with reason "stop" and are listed in
        `stopped_by_string` for the engine to abort."""
        now = time.monotonic()
        finished = []
        for out in outputs:
            record = self.records.get(out.request_id)
            if record is None or record.finish_reason is not None:
                continue
            if out.new_token_ids and record.metrics.first_token_time is None:
                record.metrics.first_token_time = now
            record.token_ids.extend(out.new_token_ids)
            record.num_cached_tokens = out.num_cached_tokens
            if record.logprobs is not None and out.new_logprobs:
                record.logprobs.extend(out.new_logprobs)
            if record.detokenizer is not None:
                num_before = len(record.detokenizer.token_ids)
                stop = record.detokenizer.append(out.new_token_ids)
                if stop is not None:
                    # A multi-token step (accepted drafts) may run past the stop string:
                    # keep the tokens up to the one that completed it, drop the rest.
                    extra = len(out.new_token_ids) - (
                        len(record.detokenizer.token_ids) - num_before
                    )
                    if extra:
                        del record.token_ids[-extra:]
                        if record.logprobs:
                            del record.logprobs[len(record.token_ids) :]
                if stop is not None and out.finish_reason is None:
                    record.finish_reason = "stop"
                    record.stop_reason = stop
                    record.metrics.finished_time = now
                    finished.append(out.request_id)
                    self.stopped_by_string.append(out.request_id)
                    continue
            if out.finish_reason is not None:
                record.finish_reason = out.finish_reason
                record.stop_reason = out.stop_reason
                record.error = out.error
                record.metrics.finished_time = now
                finished.append(out.request_id)
        return finished

    def fail(self, request_id: str, error: str) -> None:
        record = self.records.get(request_id)
        if record is not None and record.finish_reason is None:
            record.finish_reason = "error"
            record.error = error
            record.metrics.finished_time = time.monotonic()

    def request_output(self, request_id: str) -> RequestOutput:
        record = self.records[request_id]
        completion = CompletionOutput(
            index=0,
            text=record.detokenizer.text if record.detokenizer is not None else "",
            logprobs=record.logprobs,
            token_ids=list(record.token_ids),
            finish_reason=record.finish_reason,
            stop_reason=record.stop_reason,
        )
        return RequestOutput(
            request_id=record.request_id,
            prompt=record.prompt,
            prompt_token_ids=record.prompt_token_ids,
            outputs=[completion],
            finished=record.finish_reason is not None,
            metrics=record.metrics,
            num_cached_tokens=record.num_cached_tokens,
            error=record.error,
        )

    def pop(self, request_id: str) -> RequestOutput:
        output = self.request_output(request_id)
        del self.records[request_id]
        return output
