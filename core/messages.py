"""Typed messages between processes: small frozen structs, encoded as MessagePack, no pickle.

Engine -> worker: `ExecuteModel`, `SampleTokens`, `CallWorker`, `Shutdown`; worker -> engine:
`WorkerReply` (also the "started" reply, empty), `RpcReply` or `WorkerError`. The serving stack's front end <-> engine
core channel uses the same base and codec (`tandem.engine.messages`).

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
from tandem.core.scheduler_output import SchedulerOutput
from tandem.schema.sampling_params import SamplingParams


class Message(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Base of every message (both channels): the class name is its tag on the wire."""


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


class ExecuteModel(Message):
    scheduler_output: SchedulerOutput


class SampleTokens(Message):
    grammar_bitmask: TensorData | None = None


class Shutdown(Message):
    pass


class CallWorker(Message):
    """`collective_rpc`: call `worker.<method>(*args)` between steps."""

    method: str
    args: list[Any] = []


class RpcReply(Message):
    """`CallWorker`'s result (plain data)."""

    result: Any = None


class WorkerReply(Message):
    """A call's result: `output` for `SampleTokens`, None otherwise."""

    output: ModelRunnerOutput | None = None


class WorkerError(Message):
    """A call raised in the worker process: its traceback, and when a hook implementation
    raised it, that implementation's plugin, hook and `file:line` (the frames that tell it
    do not cross the pipe, so the worker names it)."""

    traceback: str
    plugin: str | None = None
    hook: str | None = None
    where: str | None = None


ToWorker = ExecuteModel | SampleTokens | CallWorker | Shutdown
FromWorker = WorkerReply | RpcReply | WorkerError


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, SamplingParams):
        return obj.model_dump(exclude_defaults=True)
    raise NotImplementedError(f"messages: cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is SamplingParams:
        return SamplingParams.model_validate(obj)
    raise NotImplementedError(f"messages: cannot decode {kind.__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decoder(kind: Any) -> msgspec.msgpack.Decoder:
    """A decoder for `kind`: one of the channel unions above (or a single message class)."""
    return msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)
