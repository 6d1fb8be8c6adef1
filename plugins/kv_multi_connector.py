"""`kv-multi`: several KV connectors at once, as vLLM's `MultiConnector`.

Options: `connectors`, a list of child connectors, each `{name, options}` (a connector
plugin as a stack file names it: `kv-offload`, an installed plugin's name, `module:Class`)
or vLLM's `{kv_connector, kv_role, kv_connector_extra_config}` (`kv_connector` through
`KV_CONNECTOR_ALIASES`, e.g. `OffloadingConnector`). Each child is built with the engine's
config and its own validated options; the children's hooks are called directly by this
plugin (never through pluggy), in list order.

Scheduler side:

- admission: every child is asked `get_num_new_matched_tokens`; the first nonzero count is
  the answer, and that child (remembered per request) gets the external tokens in
  `update_state_after_alloc`; every other child gets `num_external_tokens=0`, so it learns
  the request's blocks for saving;
- a block being loaded holds garbage if its load fails, so a child must not save it before
  the step that loads it has reported: a request holding such a block (its own external
  blocks, or a local prefix-cache hit on another request's) reaches the other children's
  `update_state_after_alloc` only once that step's `KVConnectorOutput` has been folded in
  (the rollback, if any, applied). The loading child itself is told at once;
- `build_connector_meta` gives a `MultiConnectorMetadata`: the children's plans in order,
  and `kept`, how many children kept each request finished since the last plan;
- `update_connector_output` goes to every child (each acts on its own blocks and requests);
- `request_finished` asks every child: the blocks are kept if any child keeps them, and the
  `kv_transfer_params` dicts are merged (the first child's value wins on a shared key).

Worker side: `register_kv_caches`, `wait_for_layer_load`, `wait_for_save` go to every child;
`start_load_kv` and `save_kv_layer` give child i the plan `children[i]`. `get_finished`:
the union of the children's finished loads; a request kept by n children is reported in
`finished_sending` once n distinct children reported it. The count reaches the worker in
the plan of the step whose `finished_req_ids` first name the request (both are built by the
same `schedule` after `request_finished`), so it is known before any child can report the
request finished. A request without a count (kept by no child) passes through as a single
connector's report would. `get_block_ids_with_load_errors`: the union;
`get_kv_connector_stats`: the children's counters summed name by name.

A child's hooks other than the KV-connector hooks are not called (a warning says so at
start). A name registered in-process (`register_plugin`) resolves only in the process that
registered it: with the `mp` executor name a child by entry point or `module:Class`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tandem.core import hookimpl
from tandem.core.plugin_manager import TandemPlugin
from tandem.plugins.kv_multi_children import ConnectorSpec, build_child
from tandem.schema.config import EngineConfig


@dataclass(slots=True)
class MultiConnectorMetadata:
    """One step's plan: `children[i]` is child i's plan (or None); `kept[request_id]` is
    how many children kept a request finished since the previous plan."""

    children: list[Any]
    kept: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, metadata: Any, num_children: int) -> MultiConnectorMetadata:
        """The plan itself, or rebuilt from its wire form (a mapping of the fields; a
        child's dataclass plan arrives as a mapping too, which the child rebuilds)."""
        if isinstance(metadata, MultiConnectorMetadata):
            return metadata
        if metadata is None:
            return cls([None] * num_children)
        if isinstance(metadata, Mapping):
            children = list(metadata.get("children") or [None] * num_children)
            kept = {str(k): int(v) for k, v in (metadata.get("kept") or {}).items()}
            return cls(children, kept)
        return cls(list(metadata))  # a bare list of the children's plans


@dataclass(slots=True, eq=False)
class _Deferred:
    """A request the non-loading children learn once the loads it holds have reported."""

    request: Any
    block_ids: list[int]
    ready_step: int
    children: list[int]


class MultiConnector(TandemPlugin):
    """Several KV connectors behind one (the module docstring states the contract). The
    children are built in both processes, like any connector; the scheduler-side state
    lives in the engine's instance, the keep counts and reports in the worker's."""

    role = "kv-connector"
    #: A connector made of connectors: never a child of one (`build_child`).
    contains_connectors = True

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        connectors: list[ConnectorSpec] = Field(
            ..., min_length=1, description="the child connectors, asked in this order"
        )

    def __init__(self, config: EngineConfig, options: BaseModel) -> None:
        super().__init__(config, options)
        assert isinstance(options, MultiConnector.Options)
        self.block_size = config.cache.block_size
        self.children = [
            build_child(config, spec, f"plugins: kv-multi.connectors[{i}]")
            for i, spec in enumerate(options.connectors)
        ]
        # Scheduler side.
        self._chosen: dict[str, int] = {}  # request -> child whose count was the answer
        self._loading: dict[int, int] = {}  # block -> step loading it, until reported
        self._deferred: dict[str, _Deferred] = {}
        self._kept_now: dict[str, int] = {}  # finished since the last plan -> keepers
        self._num_built = 0  # plans built (steps scheduled)
        self._num_folded = 0  # step outputs folded in
        # Worker side.
        self._expected: dict[str, int] = {}  # kept request -> children keeping it
        self._reported: dict[str, set[int]] = {}  # kept request -> children that reported

    def _each(self, hook: str, **kwargs: Any) -> list[Any]:
        return [child.call(hook, **kwargs) for child in self.children]

    # Scheduler side ---------------------------------------------------------------------
    @hookimpl
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Every child is asked; the first nonzero count answers (and its child is
        remembered for the request). Asked again, it answers the same."""
        answer: tuple[int, bool] = (0, False)
        self._chosen.pop(request.request_id, None)
        for i, child in enumerate(self.children):
            found = child.call(
                "get_num_new_matched_tokens",
                request=request,
                num_computed_tokens=num_computed_tokens,
            )
            if found is not None and found[0] and not answer[0]:
                answer = (int(found[0]), bool(found[1]))
                self._chosen[request.request_id] = i
        return answer

    @hookimpl
    def update_state_after_alloc(
        self, request: Any, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The chosen child gets the external tokens; the others get 0, at once unless the
        request holds a block whose load has not reported yet (then deferred)."""
        request_id = request.request_id
        chosen = self._chosen.pop(request_id, None)
        chosen = chosen if num_external_tokens else None
        self._deferred.pop(request_id, None)  # admitted anew: this allocation supersedes
        if num_external_tokens and chosen is None:
            raise RuntimeError(
                f"kv-multi: request {request_id!r} was admitted with {num_external_tokens} "
                "external tokens no child answered"
            )
        if chosen is not None:
            bs, step = self.block_size, self._num_built + 1  # the step being scheduled
            end = request.num_computed_tokens // bs
            for block_id in block_ids[end - num_external_tokens // bs : end]:
                self._loading[block_id] = step
            self.children[chosen].call(
                "update_state_after_alloc",
                request=request,
                block_ids=block_ids,
                num_external_tokens=num_external_tokens,
            )
        others = [i for i in range(len(self.children)) if i != chosen]
        ready = max((self._loading[b] for b in block_ids if b in self._loading), default=0)
        if ready > self._num_folded:
            self._deferred[request_id] = _Deferred(request, list(block_ids), ready, others)
            return
        for i in others:
            self.children[i].call(
                "update_state_after_alloc",
                request=request,
                block_ids=block_ids,
                num_external_tokens=0,
            )

    def _release_deferred(self, scheduler_output: Any) -> None:
        """Tell the waiting children about requests whose loads have reported (their block
        ids as of the previous plan: this step's are in `scheduler_output`)."""
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id in scheduler_output.preempted_req_ids:
            if request_id not in scheduled:  # preempted, not resent: told when admitted again
                self._deferred.pop(request_id, None)
        ready = [d for d in self._deferred.values() if d.ready_step <= self._num_folded]
        for deferred in ready:
            del self._deferred[deferred.request.request_id]
            for i in deferred.children:
                self.children[i].call(
                    "update_state_after_alloc",
                    request=deferred.request,
                    block_ids=list(deferred.block_ids),
                    num_external_tokens=0,
                )

    def _track_deferred(self, scheduler_output: Any) -> None:
        """Follow the block ids of the requests still deferred through this step."""
        if not self._deferred:
            return
        for new in scheduler_output.scheduled_new_reqs:
            deferred = self._deferred.get(new.req_id)
            if deferred is not None:
                deferred.block_ids = list(new.block_ids)
        for cached in scheduler_output.scheduled_cached_reqs:
            deferred = self._deferred.get(cached.req_id)
            if deferred is not None:
                deferred.block_ids.extend(cached.new_block_ids)

    @hookimpl
    def build_connector_meta(self, scheduler_output: Any) -> MultiConnectorMetadata | None:
        """Every child's plan, in order, with the keep counts of the requests finished
        since the previous plan; None when all of that is empty."""
        self._num_built += 1
        self._release_deferred(scheduler_output)
        plans = self._each("build_connector_meta", scheduler_output=scheduler_output)
        self._track_deferred(scheduler_output)
        kept, self._kept_now = self._kept_now, {}
        if not kept and all(plan is None for plan in plans):
            return None
        return MultiConnectorMetadata(plans, kept)

    @hookimpl
    def update_connector_output(self, connector_output: Any) -> None:
        """Every child gets the step's output; the loads of that step have now reported."""
        self._num_folded += 1
        self._each("update_connector_output", connector_output=connector_output)
        folded = self._num_folded
        self._loading = {b: step for b, step in self._loading.items() if step > folded}

    @hookimpl
    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None] | None:
        """Every child is asked: kept if any child keeps the blocks (the worker then waits
        for each keeping child's report); the children's params merged."""
        request_id = request.request_id
        self._chosen.pop(request_id, None)
        self._deferred.pop(request_id, None)
        keepers, params = 0, {}
        for answer in self._each("request_finished", request=request, block_ids=block_ids):
            if answer is None:
                continue
            keep, child_params = answer
            keepers += bool(keep)
            params = {**(child_params or {}), **params}  # the first child's value wins
        if keepers:
            self._kept_now[request_id] = keepers
        if not keepers and not params:
            return None
        return keepers > 0, params or None

    # Worker side ------------------------------------------------------------------------
    @hookimpl
    def register_kv_caches(self, kv_caches: list[tuple[Any, Any]], block_size: int) -> None:
        """Every child gets the pools."""
        self._each("register_kv_caches", kv_caches=kv_caches, block_size=block_size)

    def _plans(self, metadata: Any) -> MultiConnectorMetadata:
        return MultiConnectorMetadata.of(metadata, len(self.children))

    @hookimpl
    def start_load_kv(self, metadata: Any) -> None:
        """Child i begins its loads of `children[i]`; the keep counts are noted."""
        plans = self._plans(metadata)
        self._expected.update(plans.kept)
        for child, plan in zip(self.children, plans.children, strict=True):
            child.call("start_load_kv", metadata=plan)

    @hookimpl
    def wait_for_layer_load(self, layer_index: int) -> None:
        """Returns once every child's loads into the layer have finished."""
        self._each("wait_for_layer_load", layer_index=layer_index)

    @hookimpl
    def save_kv_layer(self, layer_index: int, metadata: Any) -> None:
        """Child i begins saving the layer as `children[i]` asks."""
        plans = self._plans(metadata)
        for child, plan in zip(self.children, plans.children, strict=True):
            child.call("save_kv_layer", layer_index=layer_index, metadata=plan)

    @hookimpl
    def wait_for_save(self) -> None:
        """Returns once no child's saves of this step read the pools."""
        self._each("wait_for_save")

    def _sent_by_all(self, request_id: str, child: int) -> bool:
        """Child `child` reported the request's save finished: whether every child keeping
        it has now (a request no count names passes through)."""
        expected = self._expected.get(request_id)
        if expected is None:
            return True
        reported = self._reported.setdefault(request_id, set())
        reported.add(child)
        if len(reported) < expected:
            return False
        del self._expected[request_id], self._reported[request_id]
        return True

    @hookimpl
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests every keeping child finished saving, the children's finished loads)."""
        sending: set[str] = set()
        recving: set[str] = set()
        for i, child in enumerate(self.children):
            answer = child.call("get_finished", finished_req_ids=finished_req_ids)
            if answer is None:
                continue
            child_sending, child_recving = answer
            recving.update(child_recving or ())
            sending.update(r for r in child_sending or () if self._sent_by_all(r, i))
        return sending, recving

    @hookimpl
    def get_block_ids_with_load_errors(self) -> set[int]:
        """The union of the children's failed loads."""
        errors: set[int] = set()
        for answer in self._each("get_block_ids_with_load_errors"):
            errors.update(answer or ())
        return errors

    @hookimpl
    def get_kv_connector_stats(self) -> dict[str, float] | None:
        """The children's counters, summed name by name (None when no child has any)."""
        total: dict[str, float] = {}
        answered = False
        for answer in self._each("get_kv_connector_stats"):
            if answer is None:
                continue
            answered = True
            for name, value in answer.items():
                total[name] = total.get(name, 0) + value
        return total if answered else None
