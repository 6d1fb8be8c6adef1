"""Typed messages between the front end (`AsyncLLM`) and its engine-core processes.

In: `AddRequest`, `AbortRequests`, `Shutdown`; out: `EngineCoreReady` (the engine is built
and reads its socket), `EngineCoreOutputs` (one step's news), `EngineCoreHeartbeat` (alive,
while there is no news), `EngineCoreDead`. Same base,
codec and round-trip guarantee as the engine <-> worker channel (`tandem.core.messages`).
"""

from __future__ import annotations

from typing import Any

from tandem.core.messages import Message, Shutdown
from tandem.core.outputs import EngineCoreOutput
from tandem.core.request import Request
from tandem.schema.sampling_params import SamplingParams


class AddRequest(Message):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0

    @classmethod
    def of(cls, r: Request) -> AddRequest:
        return cls(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_id,
                   r.arrival_time, r.priority)  # fmt: skip

    def to_request(self) -> Request:
        return Request(self.request_id, list(self.prompt_token_ids), self.sampling_params,
                       self.eos_token_id, self.arrival_time, self.priority)  # fmt: skip


class AbortRequests(Message):
    request_ids: list[str]


class EngineCoreOutputs(Message):
    """One step's outputs, for every request that has news, from engine `engine_index`;
    `stats` is `EngineCore.stats()` after that step (None when not asked for)."""

    outputs: list[EngineCoreOutput]
    engine_index: int = 0
    stats: dict[str, Any] | None = None


class EngineCoreReady(Message):
    """The engine core process built its engine and reads its input socket."""

    engine_index: int
    num_kv_blocks: int


class EngineCoreHeartbeat(Message):
    """Sent by the engine core's output thread whenever it has sent nothing for
    `HEARTBEAT_INTERVAL_S`: the process is alive. `num_steps` is the busy loop's step
    count and `has_work` whether it had requests, so a loop that stopped stepping with work
    to do can be told from an idle one."""

    engine_index: int
    num_steps: int
    has_work: bool


class EngineCoreDead(Message):
    """The engine stopped (a failed step, its worker died); the process exits after it."""

    engine_index: int
    error: str


ToEngineCore = AddRequest | AbortRequests | Shutdown
FromEngineCore = EngineCoreOutputs | EngineCoreReady | EngineCoreDead | EngineCoreHeartbeat
