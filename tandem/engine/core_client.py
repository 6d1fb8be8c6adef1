"""The front end's side of the engine-core processes: spawn, sockets, death watch.

Topology (the specification's figure 1): this process binds one PUSH socket per engine
(requests and aborts in) and one PULL socket that every engine pushes its outputs to, on
`ipc://` paths in a private temporary directory. ZeroMQ with msgspec (MessagePack, typed
structs, no pickle; `tandem.core.messages`) is vLLM's choice and ours: sends never block the
event loop (the socket queues), a slow consumer cannot deadlock the engine (the engine's
output thread owns its socket), and the channel is the same between hosts (`tcp://`).

A reader thread receives and decodes the engines' messages and hands each to `on_message`;
every `DEATH_POLL_S` it also checks that every engine process is alive and reports one that
exited to `on_death` (so a crash is noticed within a second even when the engine could not
say why). `send` is for one thread (the event loop's).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any

import zmq

from tandem.core.messages import Shutdown, decoder, encode
from tandem.engine.core_proc import run_engine_core
from tandem.engine.messages import EngineCoreDead, EngineCoreReady, FromEngineCore
from tandem.schema.config import EngineConfig

logger = logging.getLogger("tandem.engine")

#: How often the reader thread checks that the engine processes are alive (seconds).
DEATH_POLL_S = 0.1


class EngineStartError(RuntimeError):
    """An engine-core process failed to build its engine (the message says why)."""


class EngineCoreClient:
    """Owns `data_parallel_size` engine-core processes and the sockets to them."""

    def __init__(
        self,
        config: EngineConfig,
        data_parallel_size: int,
        on_message: Callable[[Any], None],
        on_death: Callable[[int, str], None],
        startup_timeout_s: float = 900.0,
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="tandem-ipc-")
        self._ctx = zmq.Context()
        self._decoder = decoder(FromEngineCore)
        self._closing = threading.Event()
        self.output = self._ctx.socket(zmq.PULL)
        output_address = f"ipc://{self._dir}/out"
        self.output.bind(output_address)
        self.inputs: list[zmq.Socket] = []
        self.processes: list[Any] = []
        context = mp.get_context("spawn")
        for index in range(data_parallel_size):
            socket = self._ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
            address = f"ipc://{self._dir}/in-{index}"
            socket.bind(address)
            self.inputs.append(socket)
            process = context.Process(
                target=run_engine_core,
                args=(config, index, address, output_address, os.getpid()),
                name=f"tandem-engine-core-{index}",
            )
            process.start()
            self.processes.append(process)
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._on_message, self._on_death = on_message, on_death
        self._reader = threading.Thread(target=self._read_loop, name="tandem-engine-reader")
        self._reader.daemon = True
        self._reader.start()

    def _wait_ready(self, timeout_s: float) -> None:
        pending = set(range(len(self.processes)))
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"engine core(s) {sorted(pending)} not ready in {timeout_s} s"
                )
            if self.output.poll(int(DEATH_POLL_S * 1000)):
                message = self._decoder.decode(self.output.recv())
                if isinstance(message, EngineCoreReady):
                    pending.discard(message.engine_index)
                elif isinstance(message, EngineCoreDead):
                    raise EngineStartError(message.error)
                continue
            for index in list(pending):
                code = self.processes[index].exitcode
                if code is not None:
                    raise EngineStartError(
                        f"engine core {index} exited with code {code} before it was ready"
                    )

    def _read_loop(self) -> None:
        """Deliver every engine core's messages and report each one's death, until closed.
        If the reader itself fails, every engine core is reported dead (so the streams in
        flight fail and the engine restarts): a dead reader must never leave them waiting."""
        try:
            self._read_until_closed()
        except Exception as exc:
            if self._closing.is_set():
                return
            logger.exception("the reader of engine-core messages failed")
            for index in range(len(self.processes)):
                self._on_death(
                    index, f"the reader of engine core {index}'s messages failed: {exc!r}"
                )

    def _read_until_closed(self) -> None:
        sentinels = {p.sentinel: i for i, p in enumerate(self.processes)}
        while not self._closing.is_set():
            try:
                if self.output.poll(int(DEATH_POLL_S * 1000)):
                    self._deliver(self.output.recv())
                    while self.output.poll(0):  # drain what is there before the death check
                        self._deliver(self.output.recv())
            except zmq.ZMQError:
                if self._closing.is_set():
                    return
                raise
            for sentinel in wait_for_sentinels(list(sentinels), timeout=0):
                index = sentinels.pop(sentinel)
                if self._closing.is_set():
                    return
                code = self.processes[index].exitcode
                self._on_death(index, f"engine core {index} exited unexpectedly (exit code {code})")

    def _deliver(self, data: bytes) -> None:
        """Decode one message and hand it to `on_message`; a failure there is logged, never
        allowed to end the reader (every stream would then hang)."""
        try:
            self._on_message(self._decoder.decode(data))
        except Exception:
            logger.exception("handling a message from an engine core failed")

    def send(self, engine_index: int, message: Any) -> None:
        self.inputs[engine_index].send(encode(message), copy=False)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask every engine to stop, wait for it (terminate on timeout), close sockets.
        Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        for socket, process in zip(self.inputs, self.processes, strict=False):
            if process.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    socket.send(encode(Shutdown()), flags=zmq.NOBLOCK)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=2)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
