"""The engine core in its own process (vLLM's `EngineCoreProc`): a busy loop and an
input/output thread pair on the front end's sockets.

Threads: the input thread reads `ToEngineCore` messages from a ZeroMQ PULL socket and puts
them on a queue; the busy loop (the process's main thread, which also runs an in-process
worker) adds and aborts requests from that queue, runs `EngineCore.run_step` while there is
work, and hands `EngineCoreOutputs` to the output thread, which writes them on a PUSH
socket. With no work the loop blocks on the input queue, so an idle engine uses no CPU.
Encoding and socket I/O happen off the loop thread (pyzmq releases the GIL while it
sends).

Liveness: the output thread sends an `EngineCoreHeartbeat` whenever it has sent nothing for
`HEARTBEAT_INTERVAL_S`, with the busy loop's step count, so the front end can tell a live
engine from a frozen or stuck one.

Lifecycle: `EngineCoreReady` once the engine is built; `EngineCoreDead` (then exit code 1)
when a step fails or the worker dies; a `Shutdown` message, or the parent process
disappearing, ends the process (exit code 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from tandem.core.messages import Shutdown, decoder, encode
from tandem.core.outputs import EngineCoreOutput
from tandem.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineCoreDead,
    EngineCoreHeartbeat,
    EngineCoreOutputs,
    EngineCoreReady,
    ToEngineCore,
)
from tandem.schema.config import EngineConfig

logger = logging.getLogger("tandem.engine_core")

#: How often the input thread checks that the parent process is alive (seconds).
PARENT_POLL_S = 0.5
#: The longest the output thread stays silent: then it sends a heartbeat (seconds).
HEARTBEAT_INTERVAL_S = 0.5


def _input_thread(ctx: Any, address: str, inbox: queue.Queue, parent_pid: int) -> None:
    import zmq

    socket = ctx.socket(zmq.PULL)
    socket.connect(address)
    messages = decoder(ToEngineCore)
    try:
        while True:
            if socket.poll(int(PARENT_POLL_S * 1000)):
                message = messages.decode(socket.recv(copy=False).buffer)
                inbox.put(message)
                if isinstance(message, Shutdown):
                    break
            elif os.getppid() != parent_pid:  # the front end is gone: stop
                inbox.put(Shutdown())
                break
        socket.close(linger=0)
    except zmq.ZMQError:  # the process is exiting and destroyed the context
        return


def _output_thread(
    ctx: Any, address: str, outbox: queue.Queue, heartbeat: Callable[[], Any | None]
) -> None:
    """Send what the busy loop puts in `outbox` until it puts None; after each silent
    `HEARTBEAT_INTERVAL_S`, send `heartbeat()` (nothing while it returns None)."""
    import zmq

    socket = ctx.socket(zmq.PUSH)
    socket.connect(address)
    while True:
        try:
            message = outbox.get(timeout=HEARTBEAT_INTERVAL_S)
        except queue.Empty:
            beat = heartbeat()
            if beat is not None:
                socket.send(encode(beat), copy=False)
            continue
        if message is None:
            break
        socket.send(encode(message), copy=False)
    socket.close(linger=2000)


class EngineCoreProc:
    """The busy loop around one `EngineCore`."""

    def __init__(self, config: EngineConfig, engine_index: int) -> None:
        from tandem.core.engine_core import EngineCore

        self.engine = EngineCore(config)
        self.engine_index = engine_index
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self._idle_reported = True
        #: Written by the busy loop only; the output thread's heartbeat reads them.
        self.num_steps = 0
        self.busy = False

    def heartbeat(self) -> EngineCoreHeartbeat:
        return EngineCoreHeartbeat(self.engine_index, self.num_steps, self.busy)

    def _handle(self, message: Any) -> bool:
        """Apply one input message; False for `Shutdown`."""
        if isinstance(message, AddRequest):
            request = message.to_request()
            try:
                self.engine.add_request(request)
            except Exception as exc:  # this request's own problem: report it, go on
                error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                ended = EngineCoreOutput.ended(request.request_id, "error", error)
                self._send([ended])
            self._idle_reported = False
        elif isinstance(message, AbortRequests):
            self.engine.abort_requests(message.request_ids)
            self._idle_reported = False
        elif isinstance(message, Shutdown):
            return False
        return True

    def _send(self, outputs: list[EngineCoreOutput]) -> None:
        stats = self.engine.stats()
        self.outbox.put(EngineCoreOutputs(outputs, self.engine_index, stats))

    def run(self) -> int:
        """The busy loop; returns the process's exit code."""
        while True:
            if not self.engine.has_work():
                self.busy = False
                if not self._idle_reported:  # metrics see the idle state (KV freed)
                    self._send([])
                    self._idle_reported = True
                if not self._handle(self.inbox.get()):
                    return 0
            while not self.inbox.empty():
                if not self._handle(self.inbox.get_nowait()):
                    return 0
            self.busy = True
            outputs, _ = self.engine.run_step()
            self.num_steps += 1
            if self.engine.dead_error is not None:  # every request fails with the engine
                self.outbox.put(EngineCoreDead(self.engine_index, self.engine.dead_error))
                return 1
            if outputs:
                self._send(outputs)


def run_engine_core(
    config: EngineConfig,
    engine_index: int,
    input_address: str,
    output_address: str,
    parent_pid: int,
) -> None:
    """Process entry point (spawned by `EngineCoreClient`)."""
    import zmq

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    outbox: queue.Queue = queue.Queue()
    built: list[EngineCoreProc] = []  # the heartbeat starts once the engine is built
    writer = threading.Thread(
        target=_output_thread,
        args=(ctx, output_address, outbox, lambda: built[0].heartbeat() if built else None),
        name="tandem-core-out",
    )
    writer.start()
    code = 1
    try:
        try:
            proc = EngineCoreProc(config, engine_index)
        except Exception as exc:
            detail = "".join(traceback.format_exception(exc))
            outbox.put(EngineCoreDead(engine_index, f"the engine failed to start:\n{detail}"))
            return
        proc.outbox = outbox
        reader = threading.Thread(
            target=_input_thread,
            args=(ctx, input_address, proc.inbox, parent_pid),
            name="tandem-core-in",
            daemon=True,
        )
        reader.start()
        outbox.put(EngineCoreReady(engine_index, proc.engine.config.cache.num_kv_blocks or 0))
        built.append(proc)
        code = proc.run()
        proc.engine.shutdown()
    except Exception as exc:  # the loop itself failed: report, then exit non-zero
        detail = "".join(traceback.format_exception(exc))
        outbox.put(EngineCoreDead(engine_index, f"the engine core loop failed:\n{detail}"))
        code = 1
    finally:
        outbox.put(None)
        writer.join(timeout=5)
        # Flush what the output socket still holds (up to its linger), then leave.
        with contextlib.suppress(Exception):
            ctx.destroy(linger=2000)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
