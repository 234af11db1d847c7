"""The job's Ray side: starting Ray, the Ray Data pipeline (list → fetch → classify → write) and the carry-over tasks."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.columns import conform, output_schema_like, work_schema
from pipeline.config import CPUS_PER_CPU_ACTOR, RunConfig
from pipeline.io.keys import member, uri_hashes
from pipeline.io.source import plan_listing
from pipeline.job.local_ray import LOCAL_ADDRESS, mark_session, sweep_before_start
from pipeline.job.plan import RunPlan, resolve
from pipeline.node import LOCAL_RAY_ENV, LOOPBACK, VERBOSE_ENV, local_ray_env
from pipeline.schema import CARRIED, MIB, MODEL_DIGEST, STATUS, STATUS_OK, URI
from pipeline.storage import open_fs

if TYPE_CHECKING:
    from pipeline.engines.base import EngineSpec

LOG = logging.getLogger(__name__)
FETCH_BATCH = 32
IO_TASK_CPUS = 0.25  # listing, fetch and write tasks wait on storage, not on a core
MIN_ACTOR_CPUS = 0.25  # the smallest CPU share a classify actor is given when actors outnumber CPUs
CARRY_PARTS_PER_TASK = 16  # previous shards one carry task reads, one after another
FETCH_AHEAD_BLOCKS = 16  # blocks of fetched images the fetch-ahead budget holds at least
FETCH_BLOCK_MIN = MIB
PIPELINE_OPERATORS = 4  # listing, fetch, classify, write: Ray Data splits its CPU reservation among them
# One writer actor per this many CPUs. A smaller cluster has none: there the driver commits the shards, because a
# writer's process costs a 2-core node about a second of its start for work the driver does between batches
# (docs/performance.md).
WRITER_CPUS = 8


def init_ray(plan: RunPlan) -> None:
    """Start (or join, with ``plan.ray_address``) Ray, quiet, with Ray Data's progress output off."""
    import ray
    from ray.data import DataContext

    if not LOG.isEnabledFor(logging.INFO):
        # Ray's chatter (token auth, progress-bar notices, a failed task's traceback logged before it is raised) is
        # noise to our users unless they asked for -v: failures surface as exceptions, which the CLI prints in one line.
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"address": plan.ray_address or LOCAL_ADDRESS, "log_to_driver": True,
                                  "logging_level": logging.ERROR}
        if plan.local:
            local_ray_env()
            if LOG.isEnabledFor(logging.INFO):  # -v: the workers' start reports reach this log too
                os.environ.setdefault(VERBOSE_ENV, "1")
            if plan.spec.actor_env and plan.gpus and plan.gpus[0] > 0:  # a local Ray's workers inherit it
                for key, value in plan.spec.actor_env.items():
                    os.environ.setdefault(key, value)
            sweep_before_start()
            kwargs.update(include_dashboard=False, configure_logging=True)
        context = ray.init(**kwargs)
        if plan.local:
            mark_session(context.address_info["session_dir"])
            if context.address_info.get("node_ip_address") != LOOPBACK:
                LOG.warning("the local Ray listens on %s, not only on %s: set %s before ray is imported "
                            "(pipeline.node.local_ray_env())", context.address_info.get("node_ip_address"), LOOPBACK,
                            " ".join(f"{k}={v}" for k, v in LOCAL_RAY_ENV.items()))
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.verbose_stats_logs = False


def limit_fetch_ahead(budget: int) -> None:
    """Cap Ray Data's object-store use at ``budget`` bytes (the fetch-ahead budget)."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    # Fetched bytes wait in the object store until an actor classifies them; without a cap Ray Data lets them
    # run ahead up to the store's size (by default a share of the node's RAM), and memory grows with the input.
    limits = ctx.execution_options.resource_limits
    ctx.execution_options.resource_limits = limits.copy(object_store_memory=budget)
    # Ray Data merges a task's outputs into blocks of up to target_max_block_size, each held whole in the store until
    # the actor has classified its last row: blocks much smaller than the budget keep it a bound.
    ctx.target_max_block_size = fetch_block_bytes(budget)


def fetch_block_bytes(budget: int) -> int:
    """The largest block of fetched images: a FETCH_AHEAD_BLOCKS-th of the budget, within FETCH_BLOCK_MIN and Ray
    Data's own default."""
    from ray.data.context import DEFAULT_TARGET_MAX_BLOCK_SIZE

    return min(DEFAULT_TARGET_MAX_BLOCK_SIZE, max(FETCH_BLOCK_MIN, budget // FETCH_AHEAD_BLOCKS))


def fetch_budget(actors: int, batch_size: int, *, on_gpu: bool) -> int:
    """The default fetch-ahead bytes for ``actors`` classify actors taking ``batch_size`` images per call: what a
    GPU or a CPU actor classifies in a while, and at least FETCH_AHEAD_BATCHES calls of large images each."""
    from pipeline.config import (
        FETCH_AHEAD_BATCHES, FETCH_AHEAD_IMAGE_BYTES, FETCH_AHEAD_PER_ACTOR, FETCH_AHEAD_PER_CPU_ACTOR,
    )

    per_actor = FETCH_AHEAD_PER_ACTOR if on_gpu else FETCH_AHEAD_PER_CPU_ACTOR
    return actors * max(per_actor, FETCH_AHEAD_BATCHES * batch_size * FETCH_AHEAD_IMAGE_BYTES)


@dataclass(frozen=True)
class Shares:
    """The classify actors' shares of the cluster the job runs on, decided once when Ray is up.

    Attributes:
        cpus, gpus: the cluster's, counted once.
        actors, actor_cpus, gpus_per_actor: the classify actor pool and each actor's CPU and GPU request.
        calls: engine calls each actor runs at once; engine_options: the actors' engine options, parsed (the plan's,
            with ``calls`` and the threads per call filled in where not given); actor_options: their Ray options (``runtime_env``).
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
                  calls=calls, engine_options=actor_engine_options(spec, plan.engine_options, cpus, actors, calls,
                                                                   on_gpu=on_gpu),
                  actor_options=classify_actor_options(spec, on_gpu=on_gpu, local=plan.local),
                  fetch_ahead_bytes=budget, writer_actors=writer_actors(cpus), list_tasks=max(1, list_tasks))


def actor_shares(spec: EngineSpec, cpus: int, gpus: int, *, num_actors: int | None, num_gpus_per_actor: float | None
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
    config, spec = resolve(config, gpus, "the Ray cluster")
    return actor_shares(spec, cpus, gpus, num_actors=config.num_actors, num_gpus_per_actor=config.num_gpus_per_actor)


def placeable_actors(cpus: int, gpus: int, num_gpus: float) -> int:
    """The most classify actors ``cpus`` CPUs and ``gpus`` GPUs hold at once beside the listing, fetch and write
    tasks (at least one): an actor pool larger than that waits forever for its last actors, and the job hangs."""
    by_cpu = int((cpus - 3 * IO_TASK_CPUS) / MIN_ACTOR_CPUS + 1e-9)
    by_gpu = int(gpus / num_gpus + 1e-9) if num_gpus else by_cpu
    return max(1, min(by_cpu, by_gpu))


def listing_groups(plan: RunPlan, shares: Shares) -> list[list]:
    """The listing plan: one group of units (folders, key ranges) per listing task."""
    config = plan.config
    return plan_listing(plan.source.fs, plan.source.root, config.extensions, shares.list_tasks,
                        follow_symlinks=config.follow_symlinks, source=config.source,
                        source_prefix=config.source_prefix)


def listing_task_cpus(cpus: int, tasks: int) -> float:
    """The CPU request of a listing task, so that Ray Data starts every planned listing task at once.

    Ray Data starts an operator's tasks within its share of the CPUs: ``op_resource_reservation_ratio`` of them split
    evenly among the operators (0.25 CPU of 2 for each of the job's four), so listing tasks of IO_TASK_CPUS ran one
    after another on 2 CPUs (the second folder half listed only after the first). The plan already bounds the
    listing's concurrency (one group per task); the request only has to fit that share.
    """
    from ray.data import DataContext

    share = cpus * DataContext.get_current().op_resource_reservation_ratio / PIPELINE_OPERATORS
    return max(0.01, min(IO_TASK_CPUS, math.floor(share / max(1, tasks) * 100) / 100))  # Ray counts 1/10,000ths


def classify_dataset(plan: RunPlan, shares: Shares, groups: list[list], done: Any, previous: Any, counter: Any,
                     excluded: str | None = None, *, model_digest: str | None = None) -> Any:
    """List SOURCE (dropping done and carried objects), fetch, classify in the actor pool, commit shards.

    Returns the dataset: without writer actors (``shares.writer_actors``) it ends with the classified rows and the
    driver commits them; otherwise with each committed shard's stats.
    """
    import ray
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    from pipeline.actor import ClassifyActor
    from pipeline.io.fetch import fetch_batch
    from pipeline.job.listing import ListingDatasource

    config = plan.config
    listing = ListingDatasource(worker_url(config.source), config.storage_options, config.extensions, groups, done=done,
                                previous=previous, counter=counter, excluded=excluded,
                                schema=work_schema(plan.schema))
    ds = ray.data.read_datasource(listing, override_num_blocks=len(groups),
                                  num_cpus=listing_task_cpus(shares.cpus, len(groups)))
    ds = ds.map_batches(
        fetch_batch,
        fn_kwargs={"source": worker_url(config.source), "storage_options": config.storage_options,
                   "threads": config.fetch_threads, "max_bytes": config.max_bytes, "retries": config.retries},
        batch_size=FETCH_BATCH,
        batch_format="pyarrow",
        num_cpus=IO_TASK_CPUS,
        # Each concurrent task is a worker process to start; threads inside a task do the concurrent I/O.
        compute=TaskPoolStrategy(size=max(2, shares.cpus)),
    )
    ds = ds.map_batches(
        ClassifyActor,
        fn_constructor_kwargs={"model": None if plan.models else actor_ref(config.model), "models": actor_models(plan),
                               "engine": plan.spec, "top_k": config.top_k,
                               "max_bytes": config.max_bytes, "max_pixels": config.max_pixels,
                               "model_digest": model_digest, "engine_options": dict(shares.engine_options)},
        batch_size=config.batch_size,
        batch_format="pyarrow",
        compute=ActorPoolStrategy(size=shares.actors, max_concurrent_calls_per_actor=shares.calls,
                                  enable_true_multi_threading=shares.calls > 1),
        # Ray Data's actor pool restarts dead actors and retries their tasks by default (max_restarts=-1).
        num_cpus=shares.actor_cpus,
        num_gpus=shares.gpus_per_actor or None,
        **shares.actor_options,
    )
    return _write(ds, plan, shares)


def writer_actors(cpus: int) -> int:
    """Writer actors for a cluster of ``cpus`` CPUs: one per WRITER_CPUS; none below that, where the driver commits
    the shards itself (``classify_dataset`` then ends at the classify stage)."""
    return cpus // WRITER_CPUS


def call_threads(cpus: int, actors: int, calls: int) -> int:
    """Compute threads for each of an actor's concurrent calls: its share of the cluster's ``cpus`` over ``calls``.

    1 on 2 cores, the best shape there; 2 on 16 cores (4 actors x 2 calls), where 2 threads a call beat 1
    (docs/performance.md, "The CPU job on 16 cores").
    """
    return max(1, cpus // max(1, actors) // max(1, calls))


def actor_engine_options(spec: EngineSpec, engine_options: Mapping[str, Any], cpus: int, actors: int, calls: int, *,
                         on_gpu: bool) -> dict[str, Any]:
    """The classify actors' engine options: the parsed ``engine_options``; where not given, the engine's (``spec``)
    ``calls_option`` set to ``calls`` and, on CPU actors, its ``call_threads_option`` set by ``call_threads``."""
    options = dict(engine_options or {})
    if spec.calls_option and spec.calls_option not in options:
        options[spec.calls_option] = calls
    if spec.call_threads_option and spec.call_threads_option not in options and not on_gpu:
        options[spec.call_threads_option] = call_threads(cpus, actors, calls)
    return options


def classify_actor_options(spec: EngineSpec, *, on_gpu: bool, local: bool) -> dict[str, Any]:
    """Ray options of the classify actors that their engine (``spec``) asks for: on GPUs its ``EngineSpec.actor_env``,
    as a ``runtime_env`` where the workers do not inherit it already (a ``local`` Ray started with it in its
    environment; a runtime_env costs each actor a worker process of its own)."""
    if not on_gpu:
        return {}
    env = {k: v for k, v in spec.actor_env.items() if not (local and os.environ.get(k) == v)}
    return {"runtime_env": {"env_vars": env}} if env else {}


def worker_url(url: str | None) -> str | None:
    """A source, output or previous run as Ray's workers open it: a local path made absolute (``~`` expanded), since a
    worker's working directory is its own, not the driver's (a relative DEST would take carried or written rows
    elsewhere); a URL with a scheme as it is."""
    if not url or "://" in url or url.lower().startswith("file:"):
        return url
    return os.path.abspath(os.path.expanduser(url))


def actor_ref(ref: str | None) -> str | None:
    """A model as the actors load it: a folder as ``worker_url`` gives it; the built-in model's names as they are."""
    from pipeline.model.folder import DEFAULT_REFS  # noqa: PLC0415

    return ref if ref in DEFAULT_REFS else worker_url(ref)


def actor_models(plan: RunPlan) -> list[tuple[str, str, str]]:
    """A model set as the actors load it: (name, folder as ``actor_ref`` gives it, the digest the driver checked)
    each; empty for one model."""
    from pipeline.model.model_set import named_models  # noqa: PLC0415

    if plan.models is None:
        return []
    return [(m.name, actor_ref(ref), m.bundle.digest)
            for m, (_name, ref) in zip(plan.models.models, named_models(plan.config.model))]


def carry_tasks(plan: RunPlan, shares: Shares, previous_parts: list[str], carried: Any, *, model_digest: str
                ) -> list[Any]:
    """Submit the tasks that copy the previous run's rows whose identity the listing matched; their result refs.

    ``carried`` is the ref of those identities, which exists once the listing has ended: every task takes it as an
    argument, so Ray starts the first ones right then, while the new objects are still being classified. Each task
    reads CARRY_PARTS_PER_TASK previous shards one at a time and commits the matching rows itself, in shards of
    ``shard_size``: the rows never travel through the object store, and only ``ShardStats`` come back. The tasks
    form one chain per core (a task also takes the ref of the one before it in its chain): one carry task per core
    at a time, each reading and writing Parquet on a core, and no more worker processes than that.
    """
    import ray

    config = plan.config
    task = ray.remote(carry_shards).options(num_cpus=IO_TASK_CPUS)
    batches = [previous_parts[i:i + CARRY_PARTS_PER_TASK] for i in range(0, len(previous_parts),
                                                                           CARRY_PARTS_PER_TASK)]
    chains: list[Any] = [None] * max(1, min(shares.cpus, len(batches)))
    previous, output = worker_url(config.previous), worker_url(config.output)
    refs = []
    for i, paths in enumerate(batches):
        ref = task.remote(chains[i % len(chains)], paths, carried, previous=previous,
                          storage_options=config.storage_options, output=output, shard_size=config.shard_size,
                          model_digest=model_digest)
        chains[i % len(chains)] = ref
        refs.append(ref)
    return refs


def _write(ds: Any, plan: RunPlan, shares: Shares) -> Any:
    from ray.data import ActorPoolStrategy

    from pipeline.quality.statistics import quality_footer
    from pipeline.io.writer import ShardWriter

    if not shares.writer_actors:
        return ds
    return ds.map_batches(
        ShardWriter,
        fn_constructor_kwargs={"output": worker_url(plan.config.output), "storage_options": plan.config.storage_options,
                               "footer": quality_footer},
        batch_size=plan.config.shard_size,
        batch_format="pyarrow",
        num_cpus=IO_TASK_CPUS,
        compute=ActorPoolStrategy(size=shares.writer_actors),
    )


def carry_rows(table: pa.Table, carried: np.ndarray, record: Any = None, *, model_digest: str | None = None
               ) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """The ok rows of a previous shard whose identity is in ``carried``, marked ``carried``, with their uri hashes
    and identities in row order: from the shard's ``record`` when it keeps them in row order, else hashed here.

    ``model_digest`` is this run's: a row is carried only when its model's digest is this one, so the rows say so
    (rows written before digests were recorded have none)."""
    from pipeline.io.writer import row_identities

    ok = pc.fill_null(pc.equal(table.column(STATUS), STATUS_OK), False)
    n = table.num_rows
    table = table.filter(ok)
    if record is not None and record.row_order and record.uri_hashes.size == n and \
            record.identities.size == table.num_rows:
        uri_keys, ids = record.uri_hashes[ok.to_numpy(zero_copy_only=False)], record.identities
    else:
        uri_keys, ids = None, row_identities(table)
    keep = member(carried, ids)
    table = table.filter(pa.array(keep))
    uri_keys = uri_keys[keep] if uri_keys is not None else uri_hashes(table.column(URI).to_pylist())
    table = table.set_column(table.schema.get_field_index(CARRIED), CARRIED, pa.array(np.ones(table.num_rows, bool)))
    if model_digest is not None:
        table = table.set_column(table.schema.get_field_index(MODEL_DIGEST), "model_digest",
                                 pa.array([model_digest] * table.num_rows, pa.string()))
    return conform(table, output_schema_like(table.schema)), uri_keys, ids[keep]


def carry_shards(after: Any, paths: list[str], carried: np.ndarray, *, previous: str, storage_options: Any,
                 output: str, shard_size: int, model_digest: str | None = None) -> pa.Table:
    """A carry task: copy the rows of the previous shards ``paths`` whose identity is in ``carried`` into new shards
    of ``shard_size`` rows; the ``ShardStats`` rows of the shards committed. ``after`` (the task before this one in
    its chain) is ignored.

    The shards written depend only on ``paths`` and ``carried``, so a retried task rewrites the same content-named
    shards instead of adding rows.
    """
    from pipeline.quality.statistics import quality_footer
    from pipeline.io.stats import STATS_SCHEMA
    from pipeline.io.reader import read_shard
    from pipeline.io.writer import ShardRecord, write_shard

    fs, _root = open_fs(previous, storage_options)
    held: list[tuple[pa.Table, np.ndarray, np.ndarray]] = []
    stats: list[pa.Table] = []

    def commit(parts: list[tuple[pa.Table, np.ndarray, np.ndarray]]) -> None:
        rows = pa.concat_tables([p[0] for p in parts])
        record = ShardRecord.of_rows(rows, uri_keys=np.concatenate([p[1] for p in parts]),
                                     identities=np.concatenate([p[2] for p in parts]))
        stats.append(write_shard(rows, output=output, storage_options=storage_options, footer=quality_footer,
                                 record=record))

    for path in paths:
        table, record = read_shard(fs, path)
        rows, keys, ids = carry_rows(table, carried, record, model_digest=model_digest)
        if rows.num_rows:
            held.append((rows, keys, ids))
        while sum(p[0].num_rows for p in held) >= shard_size:
            out, rest, need = [], [], shard_size
            for rows, keys, ids in held:
                if need >= rows.num_rows:
                    out.append((rows, keys, ids))
                    need -= rows.num_rows
                elif need > 0:
                    out.append((rows.slice(0, need), keys[:need], ids[:need]))
                    rest.append((rows.slice(need), keys[need:], ids[need:]))
                    need = 0
                else:
                    rest.append((rows, keys, ids))
            held = rest
            commit(out)
    if held:
        commit(held)
    return pa.concat_tables(stats) if stats else STATS_SCHEMA.empty_table()
