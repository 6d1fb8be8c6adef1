"""A grammar backend for tests: constrains tokens by a rule on the previous token.

For a request with `SamplingParams(structured_outputs={"custom": {"modulus": m}})` the token
after `p` must satisfy `(token + p) % m == 0`. The mask depends on the request's latest
token, so under async scheduling it is only right if the kernel defers the step's sampling
until the previous step's tokens are applied (`pending_structured_output_tokens`): the
test of that two-phase path. `steps` records, per bitmask computed, whether the step was
deferred.

It is also the worked example of the `grammar_bitmask` contract (copy it):

- Rows: `1 + len(scheduled_spec_decode_tokens[rid])` per request of
  `structured_output_request_ids`, in that order, always, so they line up with the rows the
  runner expects.
- Drafts: under async scheduling the scheduled drafts are `-1` placeholders. The drafts the
  worker verifies are the request's latest proposal, `Request.draft_token_ids`, cut to the
  scheduled count and padded with token 0: `drafts_to_verify(scheduled, proposal)`, the
  helper the worker uses too. Keep no copy of drafts of your own.
- Requests that left: a request of the list may have finished or been aborted since the
  step was scheduled (its sampling was deferred and the previous step's results, or an
  abort, ended it). Its rows still come, all-ones (its tokens are discarded); it must not
  be looked up in state dropped when it left.
- Readiness: with `compile_steps: k` a constrained request's grammar "compiles" for the
  first k `schedule` calls after it arrives: it is in `requests_not_ready` until then.

    plugins: [{name: reference-scheduler}, {name: default-sampler},
              {name: fake-grammar, options: {compile_steps: 3}}]
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from pydantic import BaseModel, ConfigDict, Field

from tandem.core import hookimpl
from tandem.core.plugin_manager import PluginConfigError, TandemPlugin, TandemPluginManager
from tandem.core.request import Request, RequestStatus
from tandem.core.scheduler_output import SchedulerOutput, drafts_to_verify
from tandem.schema.config import EngineConfig


def fake_grammar_allows(previous_token: int, modulus: int, vocab_size: int) -> list[int]:
    """The tokens the fake grammar allows after `previous_token`."""
    return [t for t in range(vocab_size) if (t + previous_token) % modulus == 0]


class FakeGrammar(TandemPlugin):
    role = "grammar"
    grammar_backends = ("fake",)

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        compile_steps: int = Field(
            0, ge=0, description="schedule calls a constrained request waits for its grammar"
        )

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, FakeGrammar.Options)
        self.compile_steps = options.compile_steps
        #: Constrained requests still "compiling": schedule calls left before they are ready.
        self._compiling: dict[str, int] = {}
        if config.model.vocab_size is None:
            raise PluginConfigError("fake-grammar needs the scripted model (model.vocab_size)")
        self.vocab_size = config.model.vocab_size
        self.words = -(-self.vocab_size // 32)
        self._scheduler = None
        #: One entry per bitmask computed: was that step's sampling deferred?
        self.steps: list[bool] = []

    @hookimpl
    def tandem_stack_loaded(self, manager: TandemPluginManager) -> None:
        schedulers = manager.plugins_with_role("scheduler")
        if not schedulers or not hasattr(schedulers[0], "requests"):
            raise PluginConfigError("fake-grammar: needs a scheduler exposing `requests`")
        self._scheduler = schedulers[0]

    def _row(self, previous_token: int, modulus: int) -> torch.Tensor:
        allowed = torch.zeros(self.words * 32, dtype=torch.bool)
        allowed[fake_grammar_allows(previous_token, modulus, self.vocab_size)] = True
        weights = 1 << torch.arange(32, dtype=torch.int64)
        packed = (allowed.view(self.words, 32).to(torch.int64) * weights).sum(1)
        return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)

    @hookimpl
    def add_request(self, request: Request) -> None:
        if request.use_structured_output and self.compile_steps > 0:
            self._compiling[request.request_id] = self.compile_steps

    @hookimpl
    def requests_not_ready(self) -> Collection[str] | None:
        """Called once per `schedule`: the requests still compiling for this step."""
        if not self._compiling:
            return None
        not_ready = set(self._compiling)
        for req_id in not_ready:
            self._compiling[req_id] -= 1
            if self._compiling[req_id] == 0:
                del self._compiling[req_id]
        return not_ready

    @hookimpl
    def abort_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for req_id in request_ids:
            self._compiling.pop(req_id, None)

    @hookimpl
    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        """One row per sampled position (1 + scheduled drafts) of each constrained request,
        in `structured_output_request_ids` order. A row needs the request's latest token:
        a placeholder there means the kernel asked for the mask too early."""
        if not scheduler_output.structured_output_request_ids:
            return None
        assert self._scheduler is not None
        self.steps.append(scheduler_output.pending_structured_output_tokens)
        allow_all = torch.full((self.words,), -1, dtype=torch.int32)
        rows = []
        for req_id in scheduler_output.structured_output_request_ids:
            scheduled = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            request = self._scheduler.requests.get(req_id)
            if request is None or request.is_finished:  # left while its sampling was deferred
                rows.extend(allow_all for _ in range(1 + len(scheduled)))
                continue
            if request.num_output_placeholders > len(scheduled) + 1:
                raise AssertionError(f"{req_id}: bitmask requested before its tokens are known")
            modulus = int(request.sampling_params.structured_outputs.custom["modulus"])
            drafts = drafts_to_verify(scheduled, request.draft_token_ids)
            previous = request.all_token_ids[-1]
            for token in (*drafts, None):
                rows.append(self._row(previous, modulus))
                if token is not None:
                    previous = token
        return torch.stack(rows)
