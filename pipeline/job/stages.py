"""The job's Ray side: starting Ray, and the two Ray Data pipelines (list → fetch → classify → write; carry → write)."""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from ray.data import Datasource

from pipeline.config import RunConfig
from pipeline.engines.base import engine_spec
from pipeline.schema import OUTPUT_SCHEMA, WORK_SCHEMA, conform
from pipeline.keys import member, uri_hashes
from pipeline.source import is_local, listing_blocks, open_fs, plan_listing, resolve_keys

LOG = logging.getLogger(__name__)
FETCH_BATCH = 32
IO_TASK_CPUS = 0.25  # listing, fetch and write tasks wait on storage, not on a core
CARRY_PARTS_PER_TASK = 16  # previous shards one carry task reads, one after another
FETCH_AHEAD_BLOCKS = 16  # blocks of fetched images the fetch-ahead budget holds at least
FETCH_BLOCK_MIN = 1024 * 1024
# Ray's own metrics collection runs a periodic OpenTelemetry export thread in every
# worker; on Ray 2.60 it crashed a worker with SIGSEGV inside
# TemporalMetricStorage::buildMetrics (seen in CI, killing an actor mid-job). A local
# Ray we start ourselves has no dashboard to read those metrics, so it runs without them;
# set either variable yourself to override. A cluster given by RAY_ADDRESS is left as is.
LOCAL_RAY_ENV = {"RAY_enable_metrics_collection": "0", "RAY_enable_open_telemetry": "0"}


def local_ray_env() -> None:
    """Set the environment a local Ray we start needs (workers inherit it)."""
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)


def init_ray(config: RunConfig) -> None:
    """Start (or join, with RAY_ADDRESS) Ray, quiet, with the fetch-ahead budget on Ray Data's object store use."""
    import ray
    from ray.data import DataContext

    if not LOG.isEnabledFor(logging.INFO):
        # Ray's start-up chatter (token auth, progress-bar notices) is noise to
        # our users unless they asked for -v; real failures still surface as exceptions.
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.ERROR)
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS") or None
        kwargs: dict[str, Any] = {"address": address, "log_to_driver": True, "logging_level": logging.ERROR}
        if address is None:
            local_ray_env()
            kwargs.update(include_dashboard=False, configure_logging=True)
        ray.init(**kwargs)
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.verbose_stats_logs = False
    # Fetched bytes wait in the object store until an actor classifies them; without a cap Ray Data lets them
    # run ahead up to the store's size (30 % of a node's RAM), so memory grew with the input, not with the rate.
    budget = fetch_ahead_bytes(config)
    limits = ctx.execution_options.resource_limits
    ctx.execution_options.resource_limits = limits.copy(object_store_memory=budget)
    # Ray Data merges a task's outputs into blocks of up to target_max_block_size (128 MiB): a fetch task's images
    # became blocks of 128 MiB, each held whole in the store until the actor had classified its last row, so the
    # budget bounded nothing below a few such blocks (758 MiB of the store in use at 20,000 images of 40 KB).
    ctx.target_max_block_size = fetch_block_bytes(budget)


def fetch_ahead_bytes(config: RunConfig) -> int:
    """The object-store budget: ``--fetch-ahead-bytes`` or, by default, sized by the classify actors (see
    ``fetch_budget``)."""
    if config.fetch_ahead_bytes is not None:
        return config.fetch_ahead_bytes
    actors, _cpus, gpus = _actor_plan(config)
    return fetch_budget(actors, config.batch_size, on_gpu=gpus > 0)


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


def _actor_plan(config: RunConfig) -> tuple[int, float, float]:
    """(actors, CPUs per actor, GPUs per actor) for this cluster."""
    import ray

    resources = ray.cluster_resources()
    return actor_plan(config, int(resources.get("CPU", 1)), int(resources.get("GPU", 0)))


def actor_plan(config: RunConfig, cpus: int, gpus: int) -> tuple[int, float, float]:
    """(actors, CPUs per actor, GPUs per actor) on ``cpus`` CPUs and ``gpus`` GPUs: a GPU engine's actors take
    1 / its ``actors_per_gpu`` of a GPU each unless ``--num-gpus-per-actor`` says otherwise."""
    gpu_engine = engine_spec(config.engine).needs_gpu and gpus > 0
    default_gpus = 1.0 / engine_spec(config.engine).actors_per_gpu if gpu_engine else 0.0
    num_gpus = config.num_gpus_per_actor if config.num_gpus_per_actor is not None else default_gpus
    if config.num_actors is not None:
        actors = config.num_actors
    elif num_gpus:
        actors = max(1, int(gpus / num_gpus))
    else:
        actors = max(1, cpus // 4)
    # Leave CPU for the listing, fetch and write tasks, or a pool that takes every CPU deadlocks the job.
    actor_cpus = 1.0 if actors < cpus else max(0.25, (cpus - 3 * IO_TASK_CPUS) / actors)
    return actors, actor_cpus, num_gpus


def classify_dataset(config: RunConfig, done: Any, previous: Any, counter: Any):
    """List SOURCE (dropping done and carried objects), fetch, classify in the actor pool, commit shards."""
    import ray
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    from pipeline.actor import ClassifyActor
    from pipeline.fetch import fetch_batch

    cpus = int(ray.cluster_resources().get("CPU", 1))
    actors, actor_cpus, num_gpus = _actor_plan(config)
    calls = config.calls_per_actor or engine_spec(config.engine).calls_per_actor
    listing = ListingDatasource(config.source, config.storage_options, config.extensions, done=done,
                                previous=previous, counter=counter)
    # At most list_tasks read tasks are planned, so at most that many LIST calls are outstanding. A local listing
    # waits on no network: more tasks than cores would only start more worker processes (each imports Ray Data).
    list_tasks = min(config.list_tasks, cpus) if is_local(open_fs(config.source, config.storage_options)[0]) \
        else config.list_tasks
    ds = ray.data.read_datasource(listing, override_num_blocks=list_tasks, num_cpus=IO_TASK_CPUS)
    ds = ds.map_batches(
        fetch_batch,
        fn_kwargs={"source": config.source, "storage_options": config.storage_options,
                   "threads": config.fetch_threads, "max_bytes": config.max_bytes, "retries": config.retries},
        batch_size=FETCH_BATCH,
        batch_format="pyarrow",
        num_cpus=IO_TASK_CPUS,
        # Each concurrent task is a worker process to start; threads inside a task do the concurrent I/O.
        compute=TaskPoolStrategy(size=max(2, cpus)),
    )
    ds = ds.map_batches(
        ClassifyActor,
        fn_constructor_kwargs={"model": config.model, "engine": config.engine, "top_k": config.top_k,
                               "max_bytes": config.max_bytes, "max_pixels": config.max_pixels,
                               "decode_threads": config.decode_threads, "engine_options": config.engine_options},
        batch_size=config.batch_size,
        batch_format="pyarrow",
        compute=ActorPoolStrategy(size=actors, max_concurrent_calls_per_actor=calls,
                                  enable_true_multi_threading=calls > 1),
        # Ray Data's actor pool restarts dead actors and retries their tasks by default (max_restarts=-1).
        num_cpus=actor_cpus,
        num_gpus=num_gpus or None,
    )
    return _write(ds, config, cpus)


def carry_dataset(config: RunConfig, previous_parts: list[str], carried: Any):
    """Copy the previous run's rows whose identity the listing matched (``carried``), shard by shard.

    Each task reads a few previous shards one at a time and commits the matching rows itself, in shards of
    ``shard_size``: the rows never travel through the object store, and only ``ShardStats`` come back.
    """
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1))
    source = CarryDatasource(config.previous, config.storage_options, previous_parts, carried,
                             output=config.output, shard_size=config.shard_size)
    # One carry task per core at a time: each reads and writes Parquet on a core; more at once would only start
    # more worker processes, and a new worker spends seconds of CPU importing Ray Data before its first shard.
    tasks = -(-len(previous_parts) // CARRY_PARTS_PER_TASK)
    return ray.data.read_datasource(source, override_num_blocks=max(2, cpus), num_cpus=IO_TASK_CPUS,
                                    concurrency=max(1, min(tasks, cpus)))


def _write(ds: Any, config: RunConfig, cpus: int):
    from ray.data import ActorPoolStrategy

    from pipeline.quality import quality_footer
    from pipeline.writer import ShardWriter

    return ds.map_batches(
        ShardWriter,
        fn_constructor_kwargs={"output": config.output, "storage_options": config.storage_options,
                               "footer": quality_footer},
        batch_size=config.shard_size,
        batch_format="pyarrow",
        num_cpus=IO_TASK_CPUS,
        compute=ActorPoolStrategy(size=max(1, cpus // 8)),
    )


def carry_rows(table: pa.Table, carried: np.ndarray, record: Any = None) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """The ok rows of a previous shard whose identity is in ``carried``, marked ``carried``, with their uri hashes
    and identities in row order: from the shard's ``record`` when it keeps them in row order, else hashed here."""
    from pipeline.writer import row_identities

    ok = pc.fill_null(pc.equal(table.column("status"), "ok"), False)
    n = table.num_rows
    table = table.filter(ok)
    if record is not None and record.row_order and record.uri_hashes.size == n and \
            record.identities.size == table.num_rows:
        uri_keys, ids = record.uri_hashes[ok.to_numpy(zero_copy_only=False)], record.identities
    else:
        uri_keys, ids = None, row_identities(table)
    keep = member(carried, ids)
    table = table.filter(pa.array(keep))
    uri_keys = uri_keys[keep] if uri_keys is not None else uri_hashes(table.column("uri").to_pylist())
    table = table.set_column(table.schema.get_field_index("carried"), "carried", pa.array(np.ones(table.num_rows, bool)))
    return conform(table, OUTPUT_SCHEMA), uri_keys, ids[keep]


class ListingDatasource(Datasource):
    """Ray Data datasource over the source's listing: one read task per planned group of key ranges or folders.

    ``done`` and ``previous`` are Ray object refs of sorted int64 key arrays: read tasks map them from the object
    store without copying, so their memory counts once per node, not once per task. Carried identities and the
    counts go to the ``counter`` actor.
    """

    def __init__(self, url: str, storage_options: Any, extensions: tuple[str, ...], *, done: Any = None,
                 previous: Any = None, counter: Any = None):
        self.url, self.storage_options, self.extensions = url, dict(storage_options), extensions
        self.done, self.previous, self.counter = done, previous, counter

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_name(self) -> str:
        return "Listing"

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None):
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        fs, root = open_fs(self.url, self.storage_options)
        tasks = []
        for group in plan_listing(fs, root, self.extensions, max(1, parallelism)):
            meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
            tasks.append(ReadTask(lambda g=group: self._read(g), meta))
        return tasks

    def _read(self, group: list) -> Iterator[pa.Table]:
        fs, _root = open_fs(self.url, self.storage_options)
        counter = self.counter

        def report(listed: int, skipped: int, seconds: float, carried: np.ndarray | None) -> None:
            if counter is not None:
                counter.add.remote(listed, skipped, seconds)
                if carried is not None:
                    counter.add_carried.remote(carried)

        for block in listing_blocks(fs, group, self.extensions, done=resolve_keys(self.done),
                                    previous=resolve_keys(self.previous), report=report):
            yield conform(block, WORK_SCHEMA)


class CarryDatasource(Datasource):
    """Read tasks over the previous run's shards, a few per task, that commit the rows to carry themselves.

    A task's shards depend only on its previous shards and the carry set, so a retried task rewrites the same
    content-named shards instead of adding rows.
    """

    def __init__(self, url: str, storage_options: Any, parts: list[str], carried: Any, *, output: str,
                 shard_size: int):
        self.url, self.storage_options, self.parts, self.carried = url, dict(storage_options), parts, carried
        self.output, self.shard_size = output, shard_size

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_name(self) -> str:
        return "CarryOver"

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None):
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        tasks = []
        step = CARRY_PARTS_PER_TASK
        for i in range(0, len(self.parts), step):
            meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
            tasks.append(ReadTask(lambda g=self.parts[i:i + step]: self._read(g), meta))
        return tasks

    def _read(self, paths: list[str]) -> Iterator[pa.Table]:
        from pipeline.quality import quality_footer
        from pipeline.writer import ShardRecord, read_shard, write_shard

        fs, _root = open_fs(self.url, self.storage_options)
        carried = resolve_keys(self.carried)
        held: list[tuple[pa.Table, np.ndarray, np.ndarray]] = []

        def commit(parts: list[tuple[pa.Table, np.ndarray, np.ndarray]]) -> pa.Table:
            rows = pa.concat_tables([p[0] for p in parts])
            record = ShardRecord.of_rows(rows, uri_keys=np.concatenate([p[1] for p in parts]),
                                         identities=np.concatenate([p[2] for p in parts]))
            return write_shard(rows, output=self.output, storage_options=self.storage_options, footer=quality_footer,
                               record=record)

        for path in paths:
            table, record = read_shard(fs, path)
            rows, keys, ids = carry_rows(table, carried, record)
            if rows.num_rows:
                held.append((rows, keys, ids))
            while sum(p[0].num_rows for p in held) >= self.shard_size:
                out, rest, need = [], [], self.shard_size
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
                yield commit(out)
        if held:
            yield commit(held)
