"""A grammar backend for tests: constrains tokens by a rule on the previous token.

For a request with `SamplingParams(structured_outputs={"custom": {"modulus": m}})` the token
after `p` must satisfy `(token + p) % m == 0`. The mask depends on the request's latest
token, so under async scheduling it is only right if the kernel defers the step's sampling
until the previous step's tokens are applied (`pending_structured_output_tokens`): the
test of that two-phase path. `steps` records, per bitmask computed, whether the step was
deferred.

    plugins: [{name: reference-scheduler}, {name: default-sampler}, {name: fake-grammar}]
"""

from __future__ import annotations

import torch

from tandem.core import hookimpl
from tandem.core.config import EngineConfig
from tandem.core.plugin_manager import PluginConfigError, TandemPlugin, TandemPluginManager
from tandem.core.scheduler_output import SchedulerOutput


def fake_grammar_allows(previous_token: int, modulus: int, vocab_size: int) -> list[int]:
    """The tokens the fake grammar allows after `previous_token`."""
    return [t for t in range(vocab_size) if (t + previous_token) % modulus == 0]


class FakeGrammar(TandemPlugin):
    role = "grammar"

    def __init__(self, config: EngineConfig, options) -> None:  # noqa: ANN001
        super().__init__(config, options)
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
    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        """One row per sampled position (1 + scheduled drafts) of each constrained request,
        in `structured_output_request_ids` order. A row needs the request's latest token:
        a placeholder there means the kernel asked for the mask too early."""
        if not scheduler_output.structured_output_request_ids:
            return None
        assert self._scheduler is not None
        self.steps.append(scheduler_output.pending_structured_output_tokens)
        rows = []
        for req_id in scheduler_output.structured_output_request_ids:
            request = self._scheduler.requests[req_id]
            if (
                request.num_output_placeholders
                > len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ())) + 1
            ):
                raise AssertionError(f"{req_id}: bitmask requested before its tokens are known")
            modulus = int(request.sampling_params.structured_outputs.custom["modulus"])
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, [])
            history = request.all_token_ids
            for j in range(1 + len(drafts)):
                previous = drafts[j - 1] if j > 0 else history[-1]
                rows.append(self._row(previous, modulus))
        return torch.stack(rows)
