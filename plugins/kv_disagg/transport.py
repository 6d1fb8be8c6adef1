"""The KV block transport of `kv-disagg`: a ZeroMQ server on the producer's worker that hands
out stored blocks by content key, and the consumer's client.

Why ZeroMQ over TCP: it works across hosts as well as on one (`tcp://`), pyzmq is already a
dependency (the engine-core channel), multipart messages carry each block's bytes as its own
frame without copies into one buffer, and reconnects are handled by the library. Shared
memory would only serve one host; torch.distributed would tie both engines into one process
group created up front.

Protocol (one request, one reply; every frame after the first is a block's raw bytes):

- request: a JSON frame `{"op": "has" | "get", "keys": [...], "token": T}`;
- `has` reply: `{"count": N}`, the number of leading keys the producer holds (a prefix:
  a block is useful only with every block before it);
- `get` reply: `{"blocks": [{"dtype", "shape"} | null, ...]}` then one frame per present
  block, in order; null for a key the producer no longer holds;
- an error reply: `{"error": "..."}` (bad token, malformed request, over `MAX_KEYS`).

The token (option `auth_token`, or the environment variable it names) is compared in constant
time; without one the server binds only where its options say (default 127.0.0.1). A key
is a sha256 chained over the whole prefix (`kv_offload.keys`): a client can fetch a block
only by knowing every token before its end.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # pyzmq is imported where a connection is made, not with the plugin
    import zmq

logger = logging.getLogger("tandem.kv_disagg")

#: Keys one request may name (a 128k-token prompt in 16-token blocks is 8192 blocks).
MAX_KEYS = 16384
#: Largest request frame the server parses (keys are 64 hex characters).
MAX_REQUEST_BYTES = MAX_KEYS * 70 + 4096


class TransportError(Exception):
    """The peer did not answer in time, or answered with an error."""


class BlockSource(Protocol):
    """What the server serves from (the offload store): both run on the server thread, so
    they must be safe beside the worker's own use of the store."""

    def holds(self, key: str) -> bool: ...

    def lookup(self, key: str) -> torch.Tensor | None: ...


class BlockServer:
    """Serves a `BlockSource` on `address` (`tcp://host:port`) from a daemon thread."""

    def __init__(self, address: str, source: BlockSource, token: str | None) -> None:
        import zmq

        self.source, self.token = source, token
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        #: The bound address (a port of 0 resolved to the one the system chose).
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-disagg-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            identity, *frames = self._socket.recv_multipart(copy=True)
            try:
                reply = self._answer(frames)
            except Exception as exc:  # one bad request never stops the server
                logger.warning("kv-disagg server: %s", exc)
                reply = [json.dumps({"error": str(exc)}).encode()]
            self._socket.send_multipart([identity, b"", *reply], copy=False)

    def _answer(self, frames: list[bytes]) -> list[Any]:
        body = frames[-1] if frames else b""
        if len(body) > MAX_REQUEST_BYTES:
            raise ValueError(f"request of {len(body)} bytes, at most {MAX_REQUEST_BYTES}")
        request = json.loads(body)
        if not isinstance(request, dict):
            raise ValueError("request: expected a JSON object")
        if self.token is not None and not hmac.compare_digest(
            str(request.get("token", "")).encode(), self.token.encode()
        ):
            raise ValueError("token: not this producer's auth_token")
        keys = request.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("keys: expected a list of strings")
        if len(keys) > MAX_KEYS:
            raise ValueError(f"keys: {len(keys)} keys, at most {MAX_KEYS}")
        if request.get("op") == "has":
            count = 0
            while count < len(keys) and self.source.holds(keys[count]):
                count += 1
            return [json.dumps({"count": count}).encode()]
        if request.get("op") != "get":
            raise ValueError(f"op: expected 'has' or 'get', got {request.get('op')!r}")
        described: list[dict[str, Any] | None] = []
        payloads: list[memoryview] = []
        for key in keys:
            payload = self.source.lookup(key)
            if payload is None:
                described.append(None)
                continue
            payload = payload.contiguous()
            dtype = str(payload.dtype).removeprefix("torch.")
            described.append({"dtype": dtype, "shape": list(payload.shape)})
            payloads.append(memoryview(payload.view(torch.uint8).numpy()))
        return [json.dumps({"blocks": described}).encode(), *payloads]


class BlockClient:
    """A consumer's connection to one producer; one request at a time (not thread-safe: each
    thread makes its own). A request not answered within `timeout_s` raises TransportError
    and the socket is replaced (a REQ socket cannot send again before a reply)."""

    def __init__(self, address: str, token: str | None, timeout_s: float) -> None:
        import zmq

        self.address, self.token, self.timeout_ms = address, token, int(timeout_s * 1000)
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None

    def _request(self, op: str, keys: Sequence[str]) -> tuple[dict[str, Any], list[Any]]:
        if self._socket is None:
            import zmq

            self._socket = self._context.socket(zmq.REQ)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self.address)
        body = {"op": op, "keys": list(keys), "token": self.token or ""}
        self._socket.send(json.dumps(body).encode())
        if not self._socket.poll(self.timeout_ms):
            self.close()
            raise TransportError(f"no answer from {self.address} in {self.timeout_ms} ms")
        header, *frames = self._socket.recv_multipart(copy=False)
        reply = json.loads(header.bytes)
        if "error" in reply:
            raise TransportError(f"{self.address}: {reply['error']}")
        return reply, frames

    def count(self, keys: Sequence[str]) -> int:
        """How many leading `keys` the producer holds."""
        if not keys:
            return 0
        reply, _ = self._request("has", keys)
        return int(reply["count"])

    def fetch(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """The blocks of `keys` (None for one the producer no longer holds)."""
        reply, frames = self._request("get", keys)
        blocks: list[torch.Tensor | None] = []
        frame_iter = iter(frames)
        for described in reply["blocks"]:
            if described is None:
                blocks.append(None)
                continue
            dtype = getattr(torch, described["dtype"])
            data = bytearray(next(frame_iter).buffer)
            blocks.append(
                torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(*described["shape"])
            )
        return blocks

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
