"""The probe: a subclass of the connector class under test that observes its answers and,
for `failure-contract`, corrupts its loads (registered in this process: the `inprocess`
executor, whose scheduler and worker sides share its log)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tandem.core import hookimpl
from tandem.core.hookspecs import PROJECT
from tandem.core.request import RequestStatus
from tandem.plugin_discovery import register_plugin, unregister_plugin
from tandem.testing.kv_conformance.runs import BLOCK_SIZE

#: Fraction of loaded blocks `failure-contract` corrupts besides the last of each load.
CORRUPT_FRACTION = 0.5
#: Standard deviation of the garbage written into a corrupted block (large: any KV computed
#: from it differs clearly).
GARBAGE_STD = 100.0
#: The name the probe subclass is registered under for a run.
PROBE_NAME = "kv-conformance-probe"


@dataclass
class _ProbeLog:
    """What a probe saw, shared by its scheduler-side and worker-side instances (one
    process: the `inprocess` executor)."""

    corrupt: bool = False
    #: Whether loads are corrupted now (`failure-contract` turns it off for the last round).
    active: bool = True
    violations: list[str] = field(default_factory=list)
    num_answers: int = 0
    injected: list[int] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def check_answer(
        self, request: Any, num_computed: int, answers: tuple[Any, Any], states: tuple[Any, Any]
    ) -> None:
        """Record every rule the answer `answers[0]` (then `answers[1]`, asked again)
        breaks; `states` is the request's state before and after."""
        self.num_answers += 1
        first, again = answers
        bs, rid, known = BLOCK_SIZE, request.request_id, request.num_tokens
        where = f"request {rid!r} ({known} known tokens, local hit {num_computed})"
        if again != first:
            self.violations.append(
                f"{where}: answered {first!r}, then {again!r} when asked again at once: "
                "the answer must be side-effect free"
            )
        if states[0] != states[1]:
            self.violations.append(
                f"{where}: the call changed the request (num_computed_tokens, num_tokens, "
                f"status) from {states[0]} to {states[1]}"
            )
        if first is None:
            return
        if not (isinstance(first, tuple) and len(first) == 2 and type(first[0]) is int):
            self.violations.append(f"{where}: answered {first!r}, expected (int, bool) or None")
            return
        n, limit = first[0], max((known - 1) // bs * bs - num_computed, 0)
        if n < 0 or n % bs:
            self.violations.append(
                f"{where}: answered {n} tokens, not a whole number of {bs}-token blocks"
            )
        elif n > limit:
            self.violations.append(
                f"{where}: answered {n} tokens, at most {limit} allowed: the count never "
                f"reaches the last known token (position {known - 1}), whose logits must be "
                "computed"
            )


@dataclass(slots=True)
class _ProbeMeta:
    """The connector's plan with what the probe corrupts: blocks loaded synchronously this
    step, and asynchronous loads' blocks by request."""

    inner: Any
    sync: list[list[int]]
    pending: dict[str, list[int]]


def _request_state(request: Any) -> tuple[int, int, Any]:
    return (request.num_computed_tokens, request.num_tokens, request.status)


def _unwrap(metadata: Any) -> Any:
    return metadata.inner if isinstance(metadata, _ProbeMeta) else metadata


class _ProbeMixin:
    """Hook implementations that observe the connector class they are mixed over (each
    calls the class's own implementation, when it has one)."""

    probe_log: ClassVar[_ProbeLog]

    def _base(self, hook: str) -> Callable[..., Any] | None:
        method = getattr(super(), hook, None)
        return method if callable(method) and hasattr(method, PROJECT + "_impl") else None

    def _probe_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_probe")
        if state is None:
            state = {"sync": [], "pending": {}, "pools": [], "load": [], "errors": set()}
            self.__dict__["_probe"] = state
        return state

    # Scheduler side
    @hookimpl
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        base = self._base("get_num_new_matched_tokens")
        if base is None:
            return None
        before = _request_state(request)
        first = base(request, num_computed_tokens)
        again = base(request, num_computed_tokens)
        states = (before, _request_state(request))
        self.probe_log.check_answer(request, num_computed_tokens, (first, again), states)
        return first

    @hookimpl
    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        base = self._base("update_state_after_alloc")
        if base is not None:
            base(request, block_ids, num_external_tokens)
        if not (self.probe_log.corrupt and num_external_tokens):
            return
        first = (request.num_computed_tokens - num_external_tokens) // BLOCK_SIZE
        blocks = list(block_ids[first : first + num_external_tokens // BLOCK_SIZE])
        state = self._probe_state()
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            state["pending"][request.request_id] = blocks
        else:
            state["sync"].append(blocks)

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        base = self._base("build_connector_meta")
        inner = base(scheduler_output) if base is not None else None
        if not self.probe_log.corrupt:
            return inner
        state = self._probe_state()
        meta = _ProbeMeta(inner, state["sync"], state["pending"])
        state["sync"], state["pending"] = [], {}
        return meta

    # Worker side
    @hookimpl
    def register_kv_caches(self, kv_caches: list[tuple[Any, Any]], block_size: int) -> None:
        self._probe_state()["pools"] = kv_caches
        base = self._base("register_kv_caches")
        if base is not None:
            base(kv_caches, block_size)

    @hookimpl
    def start_load_kv(self, metadata: Any) -> None:
        state = self._probe_state()
        if isinstance(metadata, _ProbeMeta):
            state["load"] = metadata.sync
            state["pending"].update(metadata.pending)
        base = self._base("start_load_kv")
        if base is not None:
            base(_unwrap(metadata))

    @hookimpl
    def wait_for_layer_load(self, layer_index: int) -> None:
        base = self._base("wait_for_layer_load")
        if base is not None:
            base(layer_index)
        state = self._probe_state()
        if layer_index == len(state["pools"]) - 1 and state["load"]:
            for blocks in state["load"]:
                self._corrupt(blocks)
            state["load"] = []

    @hookimpl
    def save_kv_layer(self, layer_index: int, metadata: Any) -> None:
        base = self._base("save_kv_layer")
        if base is not None:
            base(layer_index, _unwrap(metadata))

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> Any:
        base = self._base("get_finished")
        answer = base(finished_req_ids) if base is not None else None
        if answer is not None:
            pending = self._probe_state()["pending"]
            for request_id in answer[1]:
                self._corrupt(pending.pop(request_id, []))
        return answer

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int] | None:
        base = self._base("get_block_ids_with_load_errors")
        own = base() if base is not None else None
        state = self._probe_state()
        injected, state["errors"] = state["errors"], set()
        return set(own or ()) | injected if (own is not None or injected) else None

    def _corrupt(self, blocks: list[int]) -> None:
        """Garbage into the last of one request's loaded `blocks` (the block right before
        those its step computes) and a seeded share of the others, reported as failed
        loads."""
        log, state = self.probe_log, self._probe_state()
        if not log.active:
            return
        for i, block_id in enumerate(blocks):
            if i < len(blocks) - 1 and log.rng.random() >= CORRUPT_FRACTION:
                continue
            for k, v in state["pools"]:
                k[block_id].normal_(std=GARBAGE_STD)
                v[block_id].normal_(std=GARBAGE_STD)
            log.injected.append(block_id)
            state["errors"].add(block_id)


@contextlib.contextmanager
def _registered(name: str, cls: type) -> Iterator[str]:
    register_plugin(name, cls)
    try:
        yield name
    finally:
        unregister_plugin(name)


@dataclass
class _Target:
    """The connector under test: the name engines resolve, its class and options."""

    name: str
    cls: type
    options: dict[str, Any]

    @contextlib.contextmanager
    def probe(self, log: _ProbeLog) -> Iterator[str]:
        """A probe subclass of the connector, registered under `PROBE_NAME`."""
        probe = type(f"Probe{self.cls.__name__}", (_ProbeMixin, self.cls), {"probe_log": log})
        with _registered(PROBE_NAME, probe) as name:
            yield name
