"""`kv-disagg`: prefill/decode disaggregation: a producer engine serves the KV blocks it
computed, a consumer engine loads them over the network instead of recomputing the prompt.

Roles (`kv_role`, from the options or vLLM's `kv_transfer_config`):

- `kv_producer` (the prefill engine): every full block a request computes is saved to the
  host store after the step that computed it, exactly as `kv-offload` does (it is that
  connector, so it also reloads its own evicted prefixes), and the worker serves the store
  on `host:port` (`transport.BlockServer`).
- `kv_consumer` (the decode engine): at admission the scheduler asks the producer how many
  of the request's next blocks it holds (`count`: leading blocks by content key); the
  request then waits in WAITING_FOR_REMOTE_KVS while the worker's loader thread fetches
  those blocks (`fetch`) into the blocks the scheduler allocated; other requests run
  meanwhile. A block the producer no longer holds, a transport error or a block of another
  layout is a failed load: the request is admitted with the blocks before it and computes
  the rest (never wrong tokens).
- `kv_both`: both.

Blocks are named by content keys rooted in an engine signature (`kv_offload.keys`), so the
pair needs no request-id plumbing: a proxy sends the prompt to the producer (max_tokens 1),
then the same request to the consumer, which finds its prefix. The two engines must share
the signature (same model files, dtype, block size, layout); across hosts whose model
copies differ in modification times set `signature` to one string on both.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import defaultdict
from typing import Any, Literal

from pydantic import BaseModel, Field

from tandem.core import hookimpl
from tandem.core.request import RequestStatus
from tandem.plugins.kv_disagg.transport import BlockClient, BlockServer, TransportError
from tandem.plugins.kv_offload.connector import OffloadConnector
from tandem.plugins.kv_offload.store import BlockLoadError
from tandem.schema.config import ConfigError, EngineConfig

logger = logging.getLogger("tandem.kv_disagg")

#: Blocks fetched per request to the producer (bounds the bytes in flight).
FETCH_CHUNK = 64
#: How long an idle consumer engine sleeps per empty step while loads are in flight.
IDLE_POLL_S = 0.002


class DisaggConnector(OffloadConnector):
    role = "kv-connector"

    class Options(OffloadConnector.Options):
        kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] | None = Field(
            None, description="default: kv_transfer.kv_role, else kv_both"
        )
        host: str = Field("127.0.0.1", description="producer: address its block server binds")
        port: int = Field(14579, ge=0, le=65535, description="producer: block server port")
        peer: str | None = Field(None, description="consumer: the producer's host:port")
        auth_token_env: str = Field(
            "TANDEM_KV_TOKEN", description="environment variable holding the shared token"
        )
        timeout_s: float = Field(30.0, gt=0, description="consumer: per transfer request")
        signature: str | None = Field(None, description="shared engine signature override")

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, DisaggConnector.Options)
        transfer = config.kv_transfer
        role = options.kv_role or (transfer.kv_role if transfer is not None else "kv_both")
        self.produces = role in ("kv_producer", "kv_both")
        self.consumes = role in ("kv_consumer", "kv_both")
        if self.consumes and not options.peer:
            raise ConfigError(
                "plugins: kv-disagg.peer: a kv_consumer needs the producer's block server "
                "address, e.g. '127.0.0.1:14579'"
            )
        if options.signature is not None:
            self.signature = options.signature
        self.token = os.environ.get(options.auth_token_env) or None
        self._client: BlockClient | None = None  # scheduler side: `count` queries
        #: request id -> (local hit asked about, tokens the producer holds past it)
        self._answers: dict[str, tuple[int, int]] = {}
        self._remote: dict[str, list[tuple[str, int]]] = {}  # loads for the next step
        self._loading: set[str] = set()  # requests whose remote load is not reported over
        # worker side
        self._server: BlockServer | None = None
        self._jobs: queue.Queue[tuple[str, list[tuple[str, int]]] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[int] = set()
        self._remote_stats: defaultdict[str, float] = defaultdict(float)

    @property
    def address(self) -> str:
        return f"tcp://{self.options.peer}"

    # Scheduler side ---------------------------------------------------------------------
    @hookimpl
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        local = (0, False)
        if self.produces:
            local = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if local[0] or not self.consumes:
            return local
        asked = self._answers.get(request.request_id)
        if asked is not None and asked[0] == num_computed_tokens:
            return asked[1], asked[1] > 0
        bs = self.block_size
        first, limit = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        num_tokens = 0
        if limit > first:
            if self._client is None:
                self._client = BlockClient(self.address, self.token, self.options.timeout_s)
            try:
                num_tokens = self._client.count(self._keys(request, limit)[first:]) * bs
            except TransportError as exc:
                logger.warning("kv-disagg: producer not reachable, prefill here: %s", exc)
        self._answers[request.request_id] = (num_computed_tokens, num_tokens)
        return num_tokens, num_tokens > 0

    @hookimpl
    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        remote = self._answers.pop(request.request_id, None)
        if (
            self.consumes
            and num_external_tokens
            and remote is not None
            and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ):
            bs = self.block_size
            end = request.num_computed_tokens // bs
            start = end - num_external_tokens // bs
            keys = self._keys(request, end)
            self._remote[request.request_id] = [(keys[i], block_ids[i]) for i in range(start, end)]
            self._loading.add(request.request_id)
            num_external_tokens = 0  # none of them comes from the local tiers
        if self.produces:
            super().update_state_after_alloc(request, block_ids, num_external_tokens)

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> dict[str, Any] | None:
        plan = super().build_connector_meta(scheduler_output) if self.produces else None
        loads, self._remote = self._remote, {}
        if plan is None and not loads:
            return None
        remote = [[req_id, [[k, b] for k, b in pairs]] for req_id, pairs in loads.items()]
        return {"offload": plan, "remote": remote}

    @hookimpl
    def update_connector_output(self, connector_output: Any) -> None:
        self._loading -= set(connector_output.finished_recving)
        if self.produces:
            super().update_connector_output(connector_output)

    @hookimpl
    def request_finished(self, request: Any, block_ids: list[int]) -> None:
        self._answers.pop(request.request_id, None)
        self._remote.pop(request.request_id, None)
        super().request_finished(request, block_ids)

    @hookimpl
    def wait_for_work(self, timeout_s: float) -> None:
        """Nothing was scheduled: while loads run, poll in short sleeps, not a spin."""
        if self._loading:
            time.sleep(min(timeout_s, IDLE_POLL_S))

    # Worker side ------------------------------------------------------------------------
    @hookimpl
    def register_kv_caches(self, kv_caches: list[tuple[Any, Any]], block_size: int) -> None:
        super().register_kv_caches(kv_caches, block_size)
        assert self._store is not None
        if self.produces:
            address = f"tcp://{self.options.host}:{self.options.port}"
            self._server = BlockServer(address, self._store, self.token)
            logger.info("kv-disagg: serving KV blocks on %s", self._server.address)
        if self.consumes:
            threading.Thread(target=self._load_loop, name="kv-disagg-loader", daemon=True).start()

    @hookimpl
    def start_load_kv(self, metadata: Any) -> None:
        if metadata is None:
            return
        if self.produces:
            super().start_load_kv(metadata.get("offload"))
        for req_id, pairs in metadata.get("remote") or ():
            self._jobs.put((str(req_id), [(str(k), int(b)) for k, b in pairs]))

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        local = super().get_finished(finished_req_ids)[1]  # local tiers' async loads
        with self._lock:
            done, self._done = self._done, set()
        return set(), done | local

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        failed = super().get_block_ids_with_load_errors() if self.produces else set()
        with self._lock:
            failed |= self._failed
            self._failed = set()
        return failed

    @hookimpl
    def get_kv_connector_stats(self) -> dict[str, float]:
        stats = super().get_kv_connector_stats() if self.produces else {}
        with self._lock:
            stats.update(self._remote_stats)
            self._remote_stats = defaultdict(float)
        return stats

    def _load_loop(self) -> None:
        """The loader thread: fetch each job's blocks and write them into the pool; report
        the request done and any block not written as failed."""
        client = BlockClient(self.address, self.token, self.options.timeout_s)
        while (job := self._jobs.get()) is not None:
            req_id, pairs = job
            started = time.perf_counter()
            failed = self._fetch_into_pool(client, pairs)
            with self._lock:
                self._done.add(req_id)
                self._failed |= failed
                loaded = len(pairs) - len(failed)
                self._remote_stats["loaded_tokens@remote"] += loaded * self.block_size
                self._remote_stats["load_seconds@remote"] += time.perf_counter() - started
                self._remote_stats["failed_loads@remote"] += len(failed)

    def _fetch_into_pool(self, client: BlockClient, pairs: list[tuple[str, int]]) -> set[int]:
        assert self._store is not None
        failed: set[int] = set()
        for i in range(0, len(pairs), FETCH_CHUNK):
            chunk = pairs[i : i + FETCH_CHUNK]
            try:
                payloads = client.fetch([key for key, _ in chunk])
            except TransportError as exc:
                logger.warning("kv-disagg: fetch failed: %s", exc)
                payloads = [None] * len(chunk)
            for (key, block_id), payload in zip(chunk, payloads, strict=True):
                try:
                    if payload is None:
                        raise BlockLoadError("the producer no longer holds it")
                    self._store.write_block(payload, block_id)
                except BlockLoadError as exc:
                    logger.warning("kv-disagg: block %s not loaded: %s", key[:16], exc)
                    failed.add(block_id)
        return failed
