"""Shared helpers for the tandem-srpt tests (plain functions, no fixtures)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.core.engine_core import EngineCore
from tandem.core.outputs import EngineCoreOutput
from tandem.core.request import Request, RequestStatus
from tandem.testing import expected_scripted_output, make_request

from tandem_srpt import SRPTOrder, SRPTQueue

VOCAB = 128
EOS = 1
STACK = Path(__file__).resolve().parent.parent / "stack.yaml"


def srpt_stack(aging_rate: float = 64.0) -> list[Any]:
    """A plugin stack naming the plugin by its entry-point name only, stacked with the
    reference scheduler."""
    return [
        "reference-scheduler",
        {"name": "srpt-order", "options": {"aging_rate": aging_rate}},
        "default-sampler",
    ]


def prompt(request_id: str, length: int) -> list[int]:
    """A deterministic prompt of `length` token ids in [2, VOCAB) (no EOS)."""
    seed = zlib.crc32(request_id.encode())
    return [2 + (seed + 37 * i + i * i) % (VOCAB - 2) for i in range(length)]


def req(request_id: str, prompt_len: int, max_tokens: int, **params: Any) -> Request:
    """A greedy request that runs exactly `max_tokens` steps of output (EOS ignored)."""
    params.setdefault("ignore_eos", True)
    return make_request(request_id, prompt(request_id, prompt_len), max_tokens=max_tokens, **params)


def expected(request: Request, max_model_len: int) -> tuple[list[int], str]:
    return expected_scripted_output(
        request.prompt_token_ids, request.sampling_params, VOCAB, EOS, max_model_len
    )


def scheduler_of(engine: EngineCore) -> Any:
    (scheduler,) = engine.plugin_manager.plugins_with_role("scheduler")
    return scheduler


def order_of(engine: EngineCore) -> SRPTOrder:
    """The engine's `srpt-order` plugin instance."""
    plugin = engine.plugin_manager.get_plugin("srpt-order")
    assert isinstance(plugin, SRPTOrder)
    return plugin


def queue_of(engine: EngineCore) -> SRPTQueue:
    """The scheduler's WAITING queue: the one `srpt-order` made."""
    queue = order_of(engine).queue
    assert queue is not None and scheduler_of(engine).waiting is queue
    return queue


@dataclass
class Run:
    """Drive an engine step by step, recording when each request is first admitted.

    `admitted[rid]` is the scheduler step (`now`, the number of earlier `schedule` calls)
    at which the request first left WAITING; `arrived[rid]` the step at which it was added.
    """

    engine: EngineCore
    requests: dict[str, Request] = field(default_factory=dict)
    arrived: dict[str, int] = field(default_factory=dict)
    admitted: dict[str, int] = field(default_factory=dict)
    admission_order: list[str] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    finish_order: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        return int(scheduler_of(self.engine).step_id)

    def add(self, request: Request) -> None:
        self.engine.add_request(request)
        self.requests[request.request_id] = request
        self.arrived[request.request_id] = self.step

    def _record(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            assert out.request_id not in self.finish_reasons, f"output after finish: {out}"
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish_reasons[out.request_id] = out.finish_reason
                self.finish_order.append(out.request_id)

    def step_once(self) -> None:
        before = self.step
        outputs, _ = self.engine.step_fn()
        self._record(outputs)
        if self.step == before:
            return
        newly = [
            rid
            for rid, r in self.requests.items()
            if rid not in self.admitted
            and (r.status != RequestStatus.WAITING or rid in self.finish_reasons)
        ]
        for rid in newly:
            self.admitted[rid] = before
        self.admission_order += sorted(newly, key=lambda rid: self.arrived[rid])

    def run_until_idle(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_work():
                return
            self.step_once()
        raise AssertionError(f"engine not idle after {max_steps} steps")

    def check_outputs(self, max_model_len: int) -> None:
        for rid, request in self.requests.items():
            want = expected(request, max_model_len)
            assert (self.tokens.get(rid, []), self.finish_reasons.get(rid)) == want, rid
