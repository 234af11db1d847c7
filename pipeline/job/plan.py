"""The run decided once: the config checked and resolved, the engine's spec, local Ray or a cluster, the opened stores,
and, once Ray is up, the classify actors' shares of the cluster. The stages and the output module take these, never
the raw options."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from pipeline.cluster import ray_address
from pipeline.config import CPUS_PER_CPU_ACTOR, RunConfig
from pipeline.engines.registry import AUTO_ENGINE, engine_spec
from pipeline.iceberg_output import IcebergOutput, is_iceberg, table_parts
from pipeline.job.local_ray import local_ray_env
from pipeline.job.stages import (
    IO_TASK_CPUS, MIN_ACTOR_CPUS, actor_engine_options, classify_actor_options, fetch_budget, placeable_actors,
    writer_actors,
)
from pipeline.source import is_local, open_fs

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Store:
    """One storage location, opened once: the URL as the run names it, its file system and root path."""

    url: str
    fs: Any
    root: str
    storage_options: Mapping[str, Any]

    @property
    def local(self) -> bool:
        return is_local(self.fs)


def open_store(url: str, storage_options: Mapping[str, Any]) -> Store:
    fs, root = open_fs(url, storage_options)
    return Store(url, fs, root, dict(storage_options))


@dataclass(frozen=True)
class RunPlan:
    """What a run is, decided before anything is written or Ray starts.

    Attributes:
        config: the options with ``auto`` resolved to an engine, the batch size filled in, and an ``iceberg://``
            output or previous replaced by its table's data folder.
        spec: the resolved engine's ``EngineSpec``.
        ray_address: the cluster the job joins (``RAY_ADDRESS``); None: a local Ray the job starts.
        output_url: the output as the user named it (an ``iceberg://`` table, or the folder).
        source, output, previous: the opened stores (previous None: nothing is carried over).
        table: the output's Iceberg table (None: a folder output); previous_parts: the previous table's current
            shards (None: a folder, listed as usual).
    """

    config: RunConfig
    spec: Any
    ray_address: str | None
    output_url: str
    source: Store
    output: Store
    previous: Store | None = None
    table: IcebergOutput | None = None
    previous_parts: list[str] | None = None

    @property
    def local(self) -> bool:
        """Whether the job starts its own Ray on this machine."""
        return self.ray_address is None

    def with_previous(self, url: str | None) -> "RunPlan":
        """This plan with ``url`` (None: none) as the previous output, its store opened."""
        config, previous, parts = _open_previous(dataclasses.replace(self.config, previous=url))
        return dataclasses.replace(self, config=config, previous=previous, previous_parts=parts)


def make_plan(config: RunConfig) -> RunPlan:
    """Check the options and the engine's requirements, resolve the engine and batch size, open the stores and check
    them (read-only): everything a run decides before Ray starts or DEST is touched.

    The engine's preflight runs in this driver only for a local Ray: with ``RAY_ADDRESS`` the cluster's nodes must
    meet it.
    """
    from pipeline.job.output import check_output, check_output_location  # noqa: PLC0415 - pyarrow, after the checks
    from pipeline.source import check_source  # noqa: PLC0415

    address = ray_address()
    if address is None:
        local_ray_env()  # before anything imports ray: Ray reads its loopback switch then
    given = None if config.engine == AUTO_ENGINE else engine_spec(config.engine)
    if address is None and given is not None:
        given.check(config.engine_options)  # before the GPUs are counted: a bad engine fails in a second
    config, spec = config.resolve(spec=given)  # auto -> an engine, and the batch size, by the cluster's GPUs
    if address is None and given is None:
        spec.check(config.engine_options)
    output_url = config.output
    table = None
    if is_iceberg(config.output):
        table = IcebergOutput(config.output, config.catalog_options)
        config = dataclasses.replace(config, output=table.data_folder)
    config, previous, previous_parts = _open_previous(config)
    source = open_store(config.source, config.storage_options)
    output = open_store(config.output, config.storage_options)
    check_output_location(source, output)  # an output that is the source or holds it: refused before anything else
    check_source(source.fs, source.root, config.source, config.extensions, follow_symlinks=config.follow_symlinks)
    check_output(output.fs, output.root, config.output)
    return RunPlan(config=config, spec=spec, ray_address=address, output_url=output_url, source=source,
                   output=output, previous=previous, table=table, previous_parts=previous_parts)


def _open_previous(config: RunConfig) -> tuple[RunConfig, Store | None, list[str] | None]:
    """``config`` with an ``iceberg://`` previous replaced by its table's data folder, the previous store and the
    table's current shards (None: a folder, listed as usual)."""
    if not config.previous:
        return config, None, None
    if not is_iceberg(config.previous):
        return config, open_store(config.previous, config.storage_options), None
    fs, root, parts = table_parts(config.previous, config.catalog_options, config.storage_options)
    config = dataclasses.replace(config, previous=fs.unstrip_protocol(root))
    return config, Store(config.previous, fs, root, dict(config.storage_options)), parts


@dataclass(frozen=True)
class Shares:
    """The classify actors' shares of the cluster the job runs on, decided once when Ray is up.

    Attributes:
        cpus, gpus: the cluster's, counted once.
        actors, actor_cpus, gpus_per_actor: the classify actor pool and each actor's CPU and GPU request.
        calls: engine calls each actor runs at once; engine_options: the actors' engine options (``calls`` and the
            threads per call filled in where not given); actor_options: their Ray options (``runtime_env``).
        fetch_ahead_bytes: the object-store budget of the running pipeline.
        writer_actors: writer actors (none: the driver commits the shards); list_tasks: listing tasks at once.
    """

    cpus: int
    gpus: int
    actors: int
    actor_cpus: float
    gpus_per_actor: float
    calls: int
    engine_options: Mapping[str, Any]
    actor_options: Mapping[str, Any]
    fetch_ahead_bytes: int
    writer_actors: int
    list_tasks: int


def count_cluster() -> tuple[int, int]:
    """(CPUs, GPUs) of the Ray cluster the job runs on; Ray must be up."""
    import ray  # noqa: PLC0415

    resources = ray.cluster_resources()
    return int(resources.get("CPU", 1)), int(resources.get("GPU", 0))


def plan_shares(plan: RunPlan, cpus: int, gpus: int) -> Shares:
    """The classify actors' shares of a cluster of ``cpus`` CPUs and ``gpus`` GPUs for ``plan``."""
    config, spec = plan.config, plan.spec
    actors, actor_cpus, gpus_per_actor = actor_shares(spec, cpus, gpus, num_actors=config.num_actors,
                                                      num_gpus_per_actor=config.num_gpus_per_actor)
    if config.num_actors is not None and actors < config.num_actors:
        LOG.warning("--num-actors %d: this Ray cluster (%d CPUs, %d GPUs) holds at most %d classify actors beside "
                    "the listing, fetch and write tasks; running %d", config.num_actors, cpus, gpus, actors, actors)
    calls = config.calls_per_actor or spec.calls_per_actor
    on_gpu = bool(gpus_per_actor)
    budget = config.fetch_ahead_bytes
    if budget is None:
        budget = fetch_budget(actors, config.batch_size, on_gpu=on_gpu)
    # At most list_tasks read tasks are planned, so at most that many LIST calls are outstanding. A local listing
    # waits on no network: more tasks than cores would only start more worker processes (each imports Ray Data).
    list_tasks = min(config.list_tasks, cpus) if plan.source.local else config.list_tasks
    return Shares(cpus=cpus, gpus=gpus, actors=actors, actor_cpus=actor_cpus, gpus_per_actor=gpus_per_actor,
                  calls=calls, engine_options=actor_engine_options(spec, config.engine_options, cpus, actors, calls,
                                                                   on_gpu=on_gpu),
                  actor_options=classify_actor_options(spec, on_gpu=on_gpu, local=plan.local),
                  fetch_ahead_bytes=budget, writer_actors=writer_actors(cpus), list_tasks=max(1, list_tasks))


def actor_shares(spec: Any, cpus: int, gpus: int, *, num_actors: int | None, num_gpus_per_actor: float | None
                 ) -> tuple[int, float, float]:
    """(actors, CPUs per actor, GPUs per actor) of engine ``spec`` on ``cpus`` CPUs and ``gpus`` GPUs: a GPU engine's
    actors take 1 / its ``actors_per_gpu`` of a GPU each unless ``--num-gpus-per-actor`` says otherwise."""
    default_gpus = 1.0 / spec.actors_per_gpu if spec.needs_gpu and gpus > 0 else 0.0
    num_gpus = num_gpus_per_actor if num_gpus_per_actor is not None else default_gpus
    if num_actors is not None:
        actors = min(num_actors, placeable_actors(cpus, gpus, num_gpus))
    elif num_gpus:
        actors = max(1, int(gpus / num_gpus))
    else:
        actors = max(1, cpus // CPUS_PER_CPU_ACTOR)
    # Leave CPU for the listing, fetch and write tasks, or a pool that takes every CPU deadlocks the job.
    actor_cpus = 1.0 if actors < cpus else max(MIN_ACTOR_CPUS, (cpus - 3 * IO_TASK_CPUS) / actors)
    return actors, actor_cpus, num_gpus


def actor_plan(config: RunConfig, cpus: int, gpus: int) -> tuple[int, float, float]:
    """(actors, CPUs per actor, GPUs per actor) that ``config`` gets on a cluster of ``cpus`` CPUs and ``gpus`` GPUs
    (``auto`` resolved as the job would resolve it there)."""
    config, spec = config.resolve(gpus=gpus, where="the Ray cluster")
    return actor_shares(spec, cpus, gpus, num_actors=config.num_actors, num_gpus_per_actor=config.num_gpus_per_actor)
