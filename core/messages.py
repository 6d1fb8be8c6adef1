"""Typed messages between processes: small frozen structs, encoded as MessagePack, no pickle.

Engine -> worker: `ExecuteModel`, `SampleTokens`, `Shutdown`; worker -> engine: `WorkerReply`
(also the "started" reply, empty) or `WorkerError`. Front end <-> engine core, in the same
style, the channel of the serving stack (`tandem.engine`): `AddRequest`, `AbortRequests`,
`Shutdown` in; `EngineCoreReady`, `EngineCoreOutputs`, `EngineCoreDead` out.

Inside a message, dataclasses (`SchedulerOutput`, `ModelRunnerOutput`, `EngineCoreOutput`)
travel field by field and are rebuilt by their type hints; `SamplingParams` (pydantic)
travels as its non-default fields and is validated again on arrival; a tensor travels as
`TensorData` (dtype name, shape, raw bytes). Every message round-trips exactly: decoding
`encode(m)` gives an equal message.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from tandem.core.model_runner_output import ModelRunnerOutput
from tandem.core.outputs import EngineCoreOutput
from tandem.core.request import Request
from tandem.core.scheduler_output import SchedulerOutput
from tandem.sampling_params import SamplingParams


class _Message(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Base of every message: the class name is its tag on the wire."""


class TensorData(msgspec.Struct, frozen=True, array_like=True):
    """A host copy of a tensor: dtype name (`"int32"`), shape and raw little-endian bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorData:
        host = tensor.detach().cpu().contiguous()
        data = host.reshape(-1).view(torch.uint8).numpy().tobytes()
        return cls(str(host.dtype).removeprefix("torch."), tuple(host.shape), data)

    def to_tensor(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=dtype).reshape(self.shape)


class ExecuteModel(_Message):
    scheduler_output: SchedulerOutput


class SampleTokens(_Message):
    grammar_bitmask: TensorData | None = None


class Shutdown(_Message):
    pass


class WorkerReply(_Message):
    """A call's result: `output` for `SampleTokens`, None otherwise."""

    output: ModelRunnerOutput | None = None


class WorkerError(_Message):
    traceback: str


class AddRequest(_Message):
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


class AbortRequests(_Message):
    request_ids: list[str]


class EngineCoreOutputs(_Message):
    """One step's outputs, for every request that has news, from engine `engine_index`;
    `stats` is `EngineCore.stats()` after that step (None when not asked for)."""

    outputs: list[EngineCoreOutput]
    engine_index: int = 0
    stats: dict[str, Any] | None = None


class EngineCoreReady(_Message):
    """The engine core process built its engine and reads its input socket."""

    engine_index: int
    num_kv_blocks: int


class EngineCoreDead(_Message):
    """The engine stopped (a failed step, its worker died); the process exits after it."""

    engine_index: int
    error: str


ToWorker = ExecuteModel | SampleTokens | Shutdown
FromWorker = WorkerReply | WorkerError
ToEngineCore = AddRequest | AbortRequests | Shutdown
FromEngineCore = EngineCoreOutputs | EngineCoreReady | EngineCoreDead


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, SamplingParams):
        return obj.model_dump(exclude_defaults=True)
    raise NotImplementedError(f"messages: cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is SamplingParams:
        return SamplingParams.model_validate(obj)
    raise NotImplementedError(f"messages: cannot decode {kind.__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(message: _Message) -> bytes:
    return _encoder.encode(message)


def decoder(kind: Any) -> msgspec.msgpack.Decoder:
    """A decoder for `kind`: one of the channel unions above (or a single message class)."""
    return msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)
