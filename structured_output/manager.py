"""The structured-output plugin (role "grammar"): per-request grammar state and the batch
bitmask, over the xgrammar or outlines-core backend.

    plugins: [reference-scheduler, default-sampler, {name: structured-output,
              options: {backend: xgrammar}}]

Life of a constrained request:

1. `add_request`: the backend is chosen (the request's `structured_outputs.backend`, else
   the plugin's `backend` option, else `config.structured_output.backend`). Cheap checks
   run now and raise `RequestRejectedError` naming the field (an unknown backend, EBNF on
   outlines-core, an unsupported regex feature, a JSON-schema keyword the backend cannot
   enforce, by its JSON path: `json_schema.prepare_schema`). `auto` takes the first
   backend of `AUTO_ORDER` (xgrammar, then outlines-core) whose checks pass, per request,
   and refuses only when none does (naming each backend's reason). The grammar is
   submitted to the compile pool (cached by (backend, spec)). Until it is compiled the
   request is in `requests_not_ready`: the scheduler leaves it in WAITING, without
   blocking others.
2. `poll_finished_requests` (each drain point, on the engine thread): a finished compile
   gives the request its matcher (it becomes ready); a compile error or a compile that
   outlives `compile_timeout_s` ends that request with `finish_reason == "error"` and a
   message naming the field and the backend. `wait_for_work` (an idle engine) blocks
   until a compile finishes, so an engine with nothing else to do does not spin. On a
   virtual clock compiles are events on it instead (`virtual_compile`, `next_event_time`).
3. `grammar_bitmask`: one int32 bitmask for the step, `1 + drafts` rows per request of
   `structured_output_request_ids`. A request without drafts gets its row in one batch
   fill per backend. With drafts: fill row 0, accept draft 1, fill row 1, ..., fill the
   bonus row, then roll the matcher back; from the first draft the grammar rejects the
   rows stay all-ones (the verifier rejects at that draft, since the target obeys that
   row's mask). Under async scheduling the scheduled drafts are `-1` placeholders; the
   rows then use the request's latest proposal, `Request.draft_token_ids`, through
   `drafts_to_verify` (cut and padded with token 0 exactly as the worker does), so they
   are the drafts the worker really verifies. A request of the
   list that left while the step's sampling was deferred has no state here: its rows
   stay all-ones.
4. `update_from_output` (after the scheduler, `trylast`): each matcher accepts the
   request's new confirmed tokens, `all_token_ids[num_prompt_tokens + num_consumed:]`.
   Drafts are never left accepted (step 3 rolls them back), so rejected drafts, stop
   trimming and stale results after a preemption need nothing here: the confirmed prefix
   is the truth. A matcher that terminates (accepted EOS) on a request that did not stop
   ends it with "stop" at the next drain point.

A matcher that raises (filling its rows, accepting a token) ends its own request with
`finish_reason == "error"` naming the grammar step at the next drain point; its rows stay
all-ones and the other requests' rows and matchers are untouched.

Invariant: a ready request's matcher state is exactly its confirmed output prefix
(`num_consumed == num_output_tokens` after every `update_from_output`).
"""

from __future__ import annotations

from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from tandem.core import hookimpl
from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.outputs import PluginFinish
from tandem.core.plugin_manager import TandemPlugin, TandemPluginManager
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler_output import SchedulerOutput, drafts_to_verify
from tandem.schema.config import EngineConfig
from tandem.schema.request_checks import RequestRejectedError
from tandem.schema.structured_outputs import StructuredOutputsParams
from tandem.structured_output import virtual_compile
from tandem.structured_output.auto_refusals import combine_refusals
from tandem.structured_output.backend import (
    AUTO_ORDER,
    BACKEND_NAMES,
    GrammarBackend,
    Matcher,
    allocate_bitmask,
)
from tandem.structured_output.compile_pool import CompilePool


@dataclass(slots=True, eq=False)
class GrammarRequest:
    """One constrained request: its compile future, then its matcher."""

    request: Request
    backend: GrammarBackend
    future: Future[Any]
    submitted: float
    matcher: Matcher | None = None
    #: Confirmed output tokens the matcher has accepted.
    num_consumed: int = 0


class StructuredOutputManager(TandemPlugin):
    """Owns per-request grammar state, the compile pool and cache, and the batch bitmask."""

    role = "grammar"
    grammar_backends = ("auto", *BACKEND_NAMES)  # auto: the first of AUTO_ORDER that enforces
    needs_tokenizer = True

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        backend: Literal["auto", "xgrammar", "outlines"] | None = Field(
            None, description="default backend; None: config.structured_output.backend"
        )
        compile_timeout_s: float = Field(30.0, gt=0, description="a longer compile fails")
        max_compile_workers: int = Field(2, ge=1)
        cache_size: int = Field(256, ge=1, description="compiled grammars kept (LRU)")
        virtual_compile_scale: float = Field(
            1.0, ge=0, description="virtual clock: compile time = measured x this (0: none)"
        )

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, StructuredOutputManager.Options)
        self.default_backend = options.backend or config.structured_output.backend
        self.compile_timeout_s = options.compile_timeout_s
        self.vocab_size = int(config.model.vocab_size or 0)
        self.eos_token_id = config.model.eos_token_id
        self.pool = CompilePool(options.max_compile_workers, options.cache_size)
        self._tokenizer: Any = None
        self._backends: dict[str, GrammarBackend] = {}
        self._states: dict[str, GrammarRequest] = {}
        self._compiling: dict[str, GrammarRequest] = {}
        self._finished: list[PluginFinish] = []
        #: Steps a bitmask was built for; of those, deferred ones (async); draft rows filled.
        self.num_bitmask_steps = 0
        self.num_deferred_steps = 0
        self.num_draft_rows = 0
        #: Constrained requests preempted after their matcher had accepted output tokens
        #: (resumed mid-grammar: the matcher keeps the confirmed prefix).
        self.num_preempted_mid_grammar = 0
        #: Requests per backend that `auto` chose (the others passed no check).
        self.auto_choices: dict[str, int] = {}
        #: Seconds from submission to compiled, per request made ready since the last
        #: `engine_stats` call (seen at a drain point; a cached grammar counts too).
        self._compile_times: list[float] = []

    # Backends ----------------------------------------------------------------------------
    def backend(self, name: str) -> GrammarBackend:
        """The backend `name`, built on first use (imports the library lazily)."""
        backend = self._backends.get(name)
        if backend is None:
            if self._tokenizer is None:
                from tandem.models.model_files import load_tokenizer

                model = self.config.model
                self._tokenizer = load_tokenizer(Path(model.tokenizer or model.model))
                if self._tokenizer is None:
                    raise RequestRejectedError(
                        f"structured_outputs: the model {model.model} has no tokenizer files"
                    )
            if self.vocab_size <= 0:
                self.vocab_size = len(self._tokenizer)
            if name == "xgrammar":
                from tandem.structured_output.xgrammar_backend import XgrammarBackend

                backend = XgrammarBackend(self._tokenizer, self.vocab_size, self.eos_token_id)
            else:
                from tandem.structured_output.outlines_backend import OutlinesBackend

                backend = OutlinesBackend(self._tokenizer, self.vocab_size, self.eos_token_id)
            self._backends[name] = backend
        return backend

    @hookimpl
    def tandem_stack_loaded(self, manager: TandemPluginManager) -> None:
        """On a virtual clock compiles are events on it (`virtual_compile`), not threads."""
        if virtual_compile.is_virtual(self.clock):
            workers, size = self.pool.max_workers, self.pool.cache_size
            scale = self.options.virtual_compile_scale
            self.pool = virtual_compile.VirtualCompilePool(self.clock, workers, size, scale)

    # Requests in and out -----------------------------------------------------------------
    @hookimpl
    def add_request(self, request: Request) -> None:
        spec = request.sampling_params.structured_outputs
        if spec is None:
            return
        rid = request.request_id
        if spec.custom is not None:
            raise RequestRejectedError(
                f"request {rid}: structured_outputs.custom: the structured-output plugin "
                f"takes json, regex, grammar, choice or json_object"
            )
        name = spec.backend or self.default_backend
        if name != "auto" and name not in BACKEND_NAMES:
            raise RequestRejectedError(
                f"request {rid}: structured_outputs.backend: unknown backend {name!r}; "
                f"expected one of auto, {', '.join(BACKEND_NAMES)}"
            )
        try:
            backend = self._choose(spec) if name == "auto" else self._checked(name, spec)
        except RequestRejectedError as exc:
            raise RequestRejectedError(f"request {rid}: {exc}") from None
        state = GrammarRequest(
            request=request,
            backend=backend,
            future=self.pool.submit(backend, spec),
            submitted=self.clock.now(),
        )
        self._states[rid] = state
        self._compiling[rid] = state

    def _checked(self, name: str, spec: StructuredOutputsParams) -> GrammarBackend:
        backend = self.backend(name)
        backend.check(spec)
        return backend

    def _choose(self, spec: StructuredOutputsParams) -> GrammarBackend:
        """`auto`: the first backend of `AUTO_ORDER` that enforces the whole constraint."""
        refusals: list[tuple[GrammarBackend, str]] = []
        for name in AUTO_ORDER:
            backend = self.backend(name)
            try:
                backend.check(spec)
            except RequestRejectedError as exc:
                refusals.append((backend, str(exc)))
                continue
            self.auto_choices[name] = self.auto_choices.get(name, 0) + 1
            return backend
        raise RequestRejectedError(combine_refusals(refusals))

    @hookimpl
    def abort_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)
            self._compiling.pop(rid, None)

    def _fail(self, rid: str, message: str) -> None:
        self._states.pop(rid, None)
        self._compiling.pop(rid, None)
        self._finished.append(PluginFinish(rid, "error", f"request {rid}: {message}"))

    @hookimpl
    def requests_not_ready(self) -> Collection[str] | None:
        """Requests whose grammar is still compiling (until the drain point that sees the
        compile finished)."""
        return self._compiling.keys() if self._compiling else None

    @hookimpl
    def wait_for_work(self, timeout_s: float) -> None:
        """The engine is idle: wait for the first compile to finish, not spin."""
        if self._compiling:
            pending = [s.future for s in self._compiling.values()]
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    @hookimpl
    def next_event_time(self) -> float | None:
        """On a virtual clock: when the first compile ends or times out; else None."""
        return virtual_compile.next_compile_event(self._compiling.values(), self.compile_timeout_s)

    @hookimpl
    def poll_finished_requests(self) -> list[PluginFinish] | None:
        if self._compiling:
            now = self.clock.now()
            for rid, state in list(self._compiling.items()):
                spec = state.request.sampling_params.structured_outputs
                assert spec is not None
                where = f"structured_outputs.{spec.kind}"
                if state.future.done():
                    del self._compiling[rid]
                    error = state.future.exception()
                    if error is not None:
                        self._fail(
                            rid,
                            f"{where}: the {state.backend.name} backend could not compile "
                            f"it: {str(error).strip()}",
                        )
                    else:
                        state.matcher = state.backend.matcher(state.future.result())
                        self._compile_times.append(now - state.submitted)
                elif now - state.submitted > self.compile_timeout_s:
                    self.pool.forget(state.future)
                    state.future.cancel()
                    self._fail(
                        rid,
                        f"{where}: the {state.backend.name} backend did not compile it within "
                        f"compile_timeout_s={self.compile_timeout_s:g} s",
                    )
        if not self._finished:
            return None
        finished, self._finished = self._finished, []
        return finished

    @hookimpl
    def engine_stats(self) -> dict[str, Any]:
        """`grammar_compile_time_s`: the compile times observed since the previous call."""
        times, self._compile_times = self._compile_times, []
        return {"grammar_compile_time_s": times}

    # The bitmask -------------------------------------------------------------------------
    @hookimpl
    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        req_ids = scheduler_output.structured_output_request_ids
        if not req_ids:
            return None
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        num_rows = sum(1 + len(spec_tokens.get(rid, ())) for rid in req_ids)
        self.num_bitmask_steps += 1
        self.num_deferred_steps += scheduler_output.pending_structured_output_tokens
        self.num_draft_rows += num_rows - len(req_ids)
        bitmask = allocate_bitmask(num_rows, self.vocab_size)
        batches: dict[str, tuple[GrammarBackend, list[Matcher], list[int], list[str]]] = {}
        row = 0
        for rid in req_ids:
            drafts = spec_tokens.get(rid, ())
            state = self._states.get(rid)
            matcher = state.matcher if state is not None else None
            if state is not None and matcher is not None and not matcher.is_terminated():
                if drafts:
                    try:
                        self._fill_spec_rows(state, matcher, list(drafts), bitmask, row)
                    except Exception as exc:  # this request's grammar: end it alone
                        self._fail_row(rid, bitmask, row, 1 + len(drafts), exc)
                else:
                    _, matchers, rows, rids = batches.setdefault(
                        state.backend.name, (state.backend, [], [], [])
                    )
                    matchers.append(matcher)
                    rows.append(row)
                    rids.append(rid)
            row += 1 + len(drafts)
        for backend, matchers, rows, rids in batches.values():
            try:
                backend.fill_bitmasks(matchers, bitmask, rows)
            except Exception:  # find the matchers that fail alone; fill the others
                for matcher, one_row, rid in zip(matchers, rows, rids, strict=True):
                    try:
                        backend.fill_bitmasks([matcher], bitmask, [one_row])
                    except Exception as exc:
                        self._fail_row(rid, bitmask, one_row, 1, exc)
        return bitmask

    def _fail_row(
        self, rid: str, bitmask: torch.Tensor, row: int, num_rows: int, error: Exception
    ) -> None:
        """End `rid` (its matcher raised); its rows allow everything again."""
        bitmask[row : row + num_rows] = -1
        self._fail(rid, f"structured output: the grammar failed: {type(error).__name__}: {error}")

    @staticmethod
    def _fill_spec_rows(
        state: GrammarRequest,
        matcher: Matcher,
        scheduled: list[int],
        bitmask: torch.Tensor,
        row: int,
    ) -> None:
        """Rows for a request verifying drafts: fill, accept a draft, fill, ..., then roll
        the matcher back to the confirmed prefix."""
        drafts = drafts_to_verify(scheduled, state.request.draft_token_ids)
        matcher.fill_bitmask(bitmask, row)
        accepted = 0
        for j, token in enumerate(drafts):
            if token < 0 or not matcher.accept_token(token):
                break  # the verifier rejects here: later rows are never used
            accepted += 1
            if matcher.is_terminated():
                break
            matcher.fill_bitmask(bitmask, row + j + 1)
        matcher.rollback(accepted)

    # Results -----------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> None:
        for rid in scheduler_output.preempted_req_ids:
            state = self._states.get(rid)
            if state is not None:
                self.num_preempted_mid_grammar += state.num_consumed > 0
        for rid in scheduler_output.structured_output_request_ids:
            state = self._states.get(rid)
            if state is None or state.matcher is None:
                continue
            request = state.request
            if request.is_finished:
                del self._states[rid]
                continue
            start = request.num_prompt_tokens + state.num_consumed
            new_tokens = request.all_token_ids[start:]
            for token in new_tokens:
                try:
                    accepted = state.matcher.accept_token(token)
                except Exception as exc:  # this request's grammar: end it alone
                    self._fail(rid, f"structured output: accepting token {token} failed: {exc}")
                    break
                if not accepted:
                    self._fail(rid, f"token {token} violates the grammar (a sampler ignored it)")
                    break
            else:
                state.num_consumed += len(new_tokens)
                if state.matcher.is_terminated():
                    del self._states[rid]
                    self._finished.append(PluginFinish(rid, "stop"))
        return None
