"""Turning per-step `EngineCoreOutput`s into the client's `RequestOutput`s.

Offline generation (`LLM.generate`) calls `process` every step and `pop`s each request's
complete output once it finished. A streaming front end calls `stream` every step instead:
it returns the `RequestOutput`s each request's `output_kind` asks for (vLLM's
`RequestOutputKind`: everything so far, only what is new, or only the final output) and
forgets requests once their final output is out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tandem.core.outputs import EngineCoreOutput, TokenLogprobs
from tandem.detokenizer import IncrementalDetokenizer
from tandem.schema.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from tandem.schema.sampling_params import RequestOutputKind, SamplingParams


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
    #: Decode tokens for `Logprob.decoded_token` (`detokenize` and a tokenizer).
    decode_logprobs: bool = False
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: PromptLogprobs | None = None
    wants_prompt_logprobs: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    #: Streaming with DELTA: tokens and characters already sent, prompt logprobs sent.
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_prompt_logprobs: bool = False


class OutputProcessor:
    """Accumulates each request's tokens in order and stamps its metrics.

    Invariant: tokens are appended exactly once, in the order the engine produced them;
    a finished request accepts nothing more. `logprobs` (when asked for) has one entry per
    token of `token_ids` and `cumulative_logprob` is the sum of those tokens' logprobs.
    """

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.records: dict[str, _RequestRecord] = {}
        #: Requests the front end ended (a stop string: "stop"; their own output could not
        #: be processed: "error"), id -> finish reason: the engine must abort them.
        self.ended_here: dict[str, str] = {}
        self._decoded: dict[int, str] = {}

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
        if params is not None:
            record.output_kind = params.output_kind
            record.wants_prompt_logprobs = params.prompt_logprobs is not None
            if params.logprobs is not None:
                record.logprobs = []
                record.cumulative_logprob = 0.0
            if self.tokenizer is not None and params.detokenize:
                record.decode_logprobs = True
                record.detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.min_tokens,
                    params.skip_special_tokens,
                    params.spaces_between_special_tokens,
                )
        self.records[request_id] = record

    def _decode_token(self, token_id: int) -> str:
        """A token decoded alone, as vLLM's `Logprob.decoded_token` (cached per id)."""
        text = self._decoded.get(token_id)
        if text is None:
            assert self.tokenizer is not None
            text = self._decoded[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprobs(self, entry: TokenLogprobs, decode: bool) -> dict[int, Logprob]:
        return {
            token: Logprob(lp, rank, self._decode_token(token) if decode else None)
            for token, (lp, rank) in entry.items()
        }

    def process(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Apply one step's outputs; return the ids that finished in it. Requests ended by
        a stop string finish here with reason "stop", and requests whose own output fails
        to process (detokenising, stop strings, logprobs) with "error" naming the failure;
        both are listed in `ended_here` for the engine to abort. The other requests of the
        step are unaffected."""
        now = time.monotonic()
        finished: list[str] = []
        for out in outputs:
            record = self.records.get(out.request_id)
            if record is None or record.finish_reason is not None:
                continue
            try:
                self._apply(record, out, now, finished)
            except Exception as exc:  # this request's own output: end it alone
                self.fail(out.request_id, f"processing the output failed: {exc!r}")
                finished.append(out.request_id)
                self.ended_here[out.request_id] = "error"
        return finished

    def _apply(
        self, record: _RequestRecord, out: EngineCoreOutput, now: float, finished: list[str]
    ) -> None:
        """Apply one request's step output to its record (see `process`)."""
        if out.new_token_ids and record.metrics.first_token_time is None:
            record.metrics.first_token_time = now
        if out.prompt_logprobs is not None and record.wants_prompt_logprobs:
            record.prompt_logprobs = [None] + [
                self._logprobs(entry, record.decode_logprobs) for entry in out.prompt_logprobs
            ]
        record.token_ids.extend(out.new_token_ids)
        record.num_cached_tokens = out.num_cached_tokens
        if record.logprobs is not None and out.new_logprobs:
            self._add_logprobs(record, out.new_token_ids, out.new_logprobs)
        if record.detokenizer is not None:
            num_before = len(record.detokenizer.token_ids)
            stop = record.detokenizer.append(
                out.new_token_ids,
                stop_terminated=out.finish_reason == "stop" and bool(out.new_token_ids),
            )
            if stop is not None:
                # A multi-token step (accepted drafts) may run past the stop string:
                # keep the tokens up to the one that completed it, drop the rest.
                extra = len(out.new_token_ids) - (len(record.detokenizer.token_ids) - num_before)
                if extra:
                    del record.token_ids[-extra:]
                    self._trim_logprobs(record)
            if stop is not None and out.finish_reason is None:
                record.finish_reason = "stop"
                record.stop_reason = stop
                record.metrics.finished_time = now
                finished.append(out.request_id)
                self.ended_here[out.request_id] = "stop"
                return
        if out.finish_reason is not None:
            record.finish_reason = out.finish_reason
            record.stop_reason = out.stop_reason
            record.error = out.error
            record.metrics.finished_time = now
            finished.append(out.request_id)

    def _add_logprobs(
        self, record: _RequestRecord, new_token_ids: list[int], entries: list[TokenLogprobs]
    ) -> None:
        assert record.logprobs is not None and record.cumulative_logprob is not None
        for token, entry in zip(new_token_ids, entries, strict=False):
            record.logprobs.append(self._logprobs(entry, record.decode_logprobs))
            record.cumulative_logprob += entry[token][0]

    @staticmethod
    def _trim_logprobs(record: _RequestRecord) -> None:
        """Drop the logprobs of tokens cut after a stop string (and their share of the
        cumulative logprob)."""
        if record.logprobs is None or record.cumulative_logprob is None:
            return
        n = len(record.token_ids)
        removed = record.logprobs[n:]
        del record.logprobs[n:]
        # The removed tokens are no longer in token_ids: each entry's first key is its
        # sampled token (`TokenLogprobs` puts it first).
        for entry in removed:
            record.cumulative_logprob -= next(iter(entry.values())).logprob

    def fail(self, request_id: str, error: str) -> None:
        record = self.records.get(request_id)
        if record is not None and record.finish_reason is None:
            record.finish_reason = "error"
            record.error = error
            record.metrics.finished_time = time.monotonic()

    def _output(self, record: _RequestRecord, delta: bool) -> RequestOutput:
        """The record as a `RequestOutput`: everything so far, or (delta) only what was not
        sent before, advancing the sent counters."""
        finished = record.finish_reason is not None
        text = record.detokenizer.visible_text(finished) if record.detokenizer else ""
        token_ids = record.token_ids
        logprobs = record.logprobs
        prompt_logprobs = record.prompt_logprobs
        if delta:
            first_token, first_char = record.sent_tokens, record.sent_chars
            record.sent_tokens, record.sent_chars = len(token_ids), len(text)
            token_ids, text = token_ids[first_token:], text[first_char:]
            logprobs = logprobs[first_token:] if logprobs is not None else None
            if record.sent_prompt_logprobs:
                prompt_logprobs = None
            record.sent_prompt_logprobs |= prompt_logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(token_ids),
            finish_reason=record.finish_reason,
            stop_reason=record.stop_reason,
            logprobs=list(logprobs) if logprobs is not None else None,
            cumulative_logprob=record.cumulative_logprob,
        )
        return RequestOutput(
            request_id=record.request_id,
            prompt=record.prompt,
            prompt_token_ids=record.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=record.metrics,
            num_cached_tokens=record.num_cached_tokens,
            error=record.error,
            prompt_logprobs=prompt_logprobs,
        )

    def request_output(self, request_id: str) -> RequestOutput:
        """Everything the request produced so far (whatever its `output_kind`)."""
        return self._output(self.records[request_id], delta=False)

    def pop(self, request_id: str) -> RequestOutput:
        output = self.request_output(request_id)
        del self.records[request_id]
        return output

    def stream(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Apply one step's outputs (as `process`) and return what each updated request's
        `output_kind` asks for: CUMULATIVE everything so far, DELTA what is new (nothing
        for a step that added no visible change, except the final output), FINAL_ONLY one
        output when it finishes. Finished requests are forgotten after their last output;
        the caller still aborts `ended_here` in the engine."""
        self.process(outputs)
        updated = list(dict.fromkeys(out.request_id for out in outputs))
        results: list[RequestOutput] = []
        for request_id in updated:
            record = self.records.get(request_id)
            if record is None:
                continue
            finished = record.finish_reason is not None
            if record.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            output = self._output(record, delta=record.output_kind == RequestOutputKind.DELTA)
            completion = output.outputs[0]
            if finished or completion.token_ids or completion.text or output.prompt_logprobs:
                results.append(output)
            if finished:
                del self.records[request_id]
        return results
