"""The `ray` executor: the same rank workers as the `mp` executor, as Ray actors that a
placement group puts on one or more hosts (one bundle per rank).

Ray is an optional extra (`pip install 'tandem[ray]'`); this module is imported only when
`parallel.executor` names it, and without Ray it fails to import with that line, which
the config resolution reports against `parallel.executor`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import traceback
from concurrent.futures import Future

try:
    import ray
    from ray.exceptions import RayError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:
    raise ImportError(f"the 'ray' executor needs Ray: pip install 'tandem[ray]' ({exc})") from None

from tandem.core.messages import FromWorker, ToWorker, WorkerError, WorkerReply, decoder, encode
from tandem.core.worker import parallel_state
from tandem.core.worker.device import resolve_device
from tandem.core.worker.executors import WorkerProcessError, answer, settle, start_worker
from tandem.core.worker.kv_memory import fit_kv_cache
from tandem.core.worker.multiproc_executor import RankedExecutor, rank_infos, uses_shm_all_reduce
from tandem.core.worker.parallel_state import RankInfo
from tandem.core.worker.shm_all_reduce import create_shm_file
from tandem.schema.config import ConfigError, EngineConfig

logger = logging.getLogger("tandem.executor")

#: How long the placement group may wait for the cluster to offer every bundle.
PLACEMENT_TIMEOUT_S = 300.0
#: How long one rank's actor may take to build its worker (load its shard of the model).
START_TIMEOUT_S = 900.0


@dataclasses.dataclass(frozen=True)
class ActorPlace:
    """Where a rank's actor runs: host name, Ray node id, process id."""

    host: str
    node_id: str
    pid: int


class RankActor:
    """One rank in a Ray actor process: it joins the process group, builds its worker, then
    answers the same encoded messages a `WorkerProcess` reads from its pipe, in submission
    order (a Ray actor with one thread runs one caller's calls in order)."""

    def __init__(self) -> None:
        self._worker = None
        self._driver = False
        self._messages = decoder(ToWorker)

    def place(self) -> ActorPlace:
        return ActorPlace(
            socket.gethostname(),
            ray.get_runtime_context().get_node_id(),
            os.getpid(),
        )

    def free_port(self, address: str) -> int:
        """A free TCP port at `address` (this actor's node: the process group's rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
            return s.getsockname()[1]

    def start(
        self, config: EngineConfig, rank: RankInfo, init_method: str, shm_path: str | None
    ) -> bytes:
        try:
            self._worker = start_worker(config, rank, init_method, shm_path)
        except BaseException:
            return encode(WorkerError(traceback.format_exc()))
        self._driver = rank.is_driver
        return encode(WorkerReply())

    def call(self, data: bytes) -> bytes:
        return answer(self._worker, self._messages.decode(data), self._driver)

    def stop(self) -> None:
        parallel_state.shutdown()


class RayExecutor(RankedExecutor):
    """`parallel.world_size` rank actors, placed by one placement group with one bundle per
    rank (`{"CPU": worker_num_threads}`, plus `{"GPU": 1}` on CUDA; packed), numbered host
    by host so that the ranks of a stage share a host when they fit, joined in one torch.distributed group whose
    rendezvous is rank 0's node address.

    The cluster: `parallel.ray_address` (or `RAY_ADDRESS`) names a running one; with
    neither, and no Ray connection in this process, a single-node cluster is started for
    this engine and stopped with it (Ray's own services listen on the host's address: Ray
    does not run on loopback alone). The process group's rendezvous is 127.0.0.1 when every
    rank shares this process's node, else rank 0's node address. A rank that raises or whose actor dies
    fails the step with an error naming the rank and host; `shutdown` kills every actor
    (ranks blocked in a collective with a dead peer never return)."""

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        self._owns_ray = False
        self._actors: list = []
        self._group = None
        self._shm = None
        self._replies = decoder(FromWorker)
        #: A rank failed or died: its peers may be blocked in a collective, so `shutdown`
        #: kills every actor at once instead of asking each to leave its group.
        self._failed = False
        if not ray.is_initialized():
            address = parallel.ray_address or os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(address="local", include_dashboard=False, log_to_driver=False)
                self._owns_ray = True
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config: EngineConfig) -> None:
        parallel = config.parallel
        cuda = resolve_device(config.model.device).type == "cuda"
        places = self._place_actors(config, cuda)
        here = ray.get_runtime_context().get_node_id()
        #: Each rank's actor: host, Ray node id, pid (rank order).
        self.places = places
        self.ranks = [
            dataclasses.replace(
                info,
                host=place.host,
                # On CUDA Ray shows each actor only its GPU; on CPU, the index on its node.
                local_rank=0
                if cuda
                else [p.node_id for p in places[: info.rank]].count(place.node_id),
                local_world_size=[p.node_id for p in places].count(place.node_id),
            )
            for info, place in zip(rank_infos(parallel), places, strict=True)
        ]
        self._driver = self.ranks[0].driver_rank
        one_host = {p.node_id for p in places} == {here}
        # Loopback when every rank shares this node, else rank 0's node address.
        address = (
            "127.0.0.1"
            if one_host
            else {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}[places[0].node_id]
        )
        if uses_shm_all_reduce(parallel) and not cuda and one_host:
            self._shm = create_shm_file(parallel.tensor_parallel_size)
        port = ray.get(self._actors[0].free_port.remote(address))
        #: The process group's rendezvous (rank 0's node).
        self.init_method = f"tcp://{address}:{port}"
        self._start_workers(config)
        fit_kv_cache(config, self)
        logger.info(
            "ray executor: %d ranks on %s",
            len(self.ranks),
            ", ".join(sorted({p.host for p in places})),
        )

    def _place_actors(self, config: EngineConfig, cuda: bool) -> list[ActorPlace]:
        """Reserve one bundle per rank, start one actor in each, and order the actors by
        host: this node first, then in bundle order, so that consecutive ranks (one stage's
        tensor-parallel group) share a host whenever the bundles allow it."""
        parallel = config.parallel
        bundle = {"CPU": float(parallel.worker_num_threads or 1)}
        if cuda:
            bundle["GPU"] = 1.0
        self._group = placement_group([dict(bundle)] * parallel.world_size, strategy="PACK")
        try:
            ray.get(self._group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"parallel.executor 'ray': the cluster cannot place {parallel.world_size} "
                f"bundles of {bundle} within {PLACEMENT_TIMEOUT_S:.0f} s (available: "
                f"{ray.available_resources()})"
            ) from None
        actor_class = ray.remote(num_cpus=0)(RankActor)
        self._actors = [
            actor_class.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(parallel.world_size)
        ]
        places: list[ActorPlace] = ray.get([a.place.remote() for a in self._actors])
        here = ray.get_runtime_context().get_node_id()
        first: dict[str, int] = {}
        for place in places:
            first.setdefault(place.node_id, len(first))
        order = sorted(
            range(len(places)),
            key=lambda i: (places[i].node_id != here, first[places[i].node_id], i),
        )
        self._actors = [self._actors[i] for i in order]
        return [places[i] for i in order]

    def _start_workers(self, config: EngineConfig) -> None:
        """Every rank joins the process group and builds its worker; the first failure is
        raised with its rank and traceback."""
        shm = str(self._shm) if self._shm is not None else None
        started = ray.get(
            [
                actor.start.remote(config, info, self.init_method, shm)
                for actor, info in zip(self._actors, self.ranks, strict=True)
            ],
            timeout=START_TIMEOUT_S,
        )
        for info, reply in zip(self.ranks, started, strict=True):
            decoded = self._replies.decode(reply)
            if isinstance(decoded, WorkerError):
                raise WorkerProcessError(
                    f"{info.describe()}: the worker failed to start:\n{decoded.traceback}"
                )

    def _send_all(self, data: bytes) -> list[Future]:
        return [self._call(i, data) for i in range(len(self._actors))]

    def _call(self, index: int, data: bytes) -> Future:
        name = self.ranks[index].describe()
        result: Future = Future()

        def done(reply: Future) -> None:
            try:
                raw = reply.result()
            except RayError as exc:
                self._failed = True
                detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                result.set_exception(
                    WorkerProcessError(f"{name}: the worker's Ray actor died ({detail})")
                )
            except BaseException as exc:  # cancelled at shutdown
                result.set_exception(WorkerProcessError(f"{name}: {exc!r}"))
            else:
                settle(result, name, self._replies.decode(raw))

        self._actors[index].call.remote(data).future().add_done_callback(done)
        return result

    def shutdown(self) -> None:
        """Stop every rank's actor (a live one leaves its process group first), remove the
        placement group, and stop the cluster when this executor started it."""
        stops = []
        for actor in [] if self._failed else self._actors:
            with contextlib.suppress(RayError):
                stops.append(actor.stop.remote())
        with contextlib.suppress(RayError, ray.exceptions.GetTimeoutError):
            ray.wait(stops, num_returns=len(stops), timeout=10)
        for actor in self._actors:
            with contextlib.suppress(RayError):
                ray.kill(actor)
        self._actors = []
        if self._group is not None:
            with contextlib.suppress(RayError):
                remove_placement_group(self._group)
            self._group = None
        if self._shm is not None:
            self._shm.unlink(missing_ok=True)
            self._shm = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False
