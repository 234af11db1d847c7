"""Wiring the job: listing → fetch → classify (actor pool) → atomic Parquet shards, resumable, with a report."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from pipeline.config import RunConfig
from pipeline.errors import ModelError, OutputError
from pipeline.schema import OUTPUT_SCHEMA
from pipeline.source import (
    ListingDatasource, check_source, identity_hash, mtime_us, open_fs, storage_failure, uri_hash,
)
from pipeline.writer import committed_parts, read_columns, read_json, write_json

LOG = logging.getLogger(__name__)
SUCCESS = "_SUCCESS"
REPORT = "_REPORT.json"
RUN_INFO = "_RUN.json"
OWNED_PREFIXES = ("part-", ".part-", "_SUCCESS", "_REPORT.json", "_RUN.json")
FETCH_BATCH = 32
IO_TASK_CPUS = 0.25  # listing, fetch and write tasks wait on storage, not on a core
ProgressCallback = Callable[[int, "int | None", int], None]


@dataclass
class RunSummary:
    """What a run did; ``report`` is what was written to ``_REPORT.json``."""

    output: str
    counts: dict[str, int] = field(default_factory=dict)
    total: int = 0
    classified: int = 0
    carried: int = 0
    already_done: int = 0
    elapsed_s: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)
    nothing_to_do: bool = False


def run_job(config: RunConfig, *, progress: ProgressCallback | None = None) -> RunSummary:
    """Classify every image under ``config.source`` that has no committed row in ``config.output``.

    Raises ``ConfigError``/``SourceError``/``OutputError``/``ModelError`` before any work when the
    arguments, storage or model are unusable. Bad images become error rows and never raise.
    """
    started_at = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    src_fs, src_root = open_fs(config.source, config.storage_options)
    check_source(src_fs, src_root, config.source)
    dst_fs, dst_root = open_fs(config.output, config.storage_options)
    _prepare_output(dst_fs, dst_root, config)

    from pipeline.model import load_model

    bundle = load_model(config.model)  # fail fast (and build the cache once) before any actor starts
    _check_compatible(dst_fs, dst_root, config, bundle.name)
    write_json(dst_fs, dst_root, RUN_INFO, {"model": bundle.name, "top_k": config.top_k, "engine": config.engine,
                                            "started_at": started_at.isoformat()})

    t_list = time.perf_counter()
    parts = committed_parts(dst_fs, dst_root)
    done_uris = read_columns(dst_fs, parts, ["uri"]).column("uri").to_pylist()
    skip_keys = np.unique(np.fromiter((uri_hash(u) for u in done_uris), dtype=np.int64, count=len(done_uris)))
    previous = _load_previous(config, bundle.name) if config.previous else None
    list_prep_s = time.perf_counter() - t_list

    import ray

    _init_ray()
    from pipeline.listing_counter import ListingCounter

    counter = ray.remote(num_cpus=0)(ListingCounter).remote()
    previous_ref = ray.put(previous) if previous is not None else None
    ds = _build_dataset(config, skip_keys, previous_ref, counter)

    totals: Counter = Counter()
    kinds: Counter = Counter()
    stage = Counter()
    done = 0
    decode_known = False
    from pipeline.metrics import JobMetrics

    metrics = JobMetrics(config.metrics_port)
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for rec in batch.to_pylist():
                done += rec["rows"]
                totals["ok"] += rec["ok"]
                totals["error"] += rec["errors"]
                totals["carried"] += rec["carried"]
                kinds.update(json.loads(rec["error_kinds"]))
                for key in ("fetch_s", "infer_s", "write_s", "engine_calls"):
                    stage[key] += rec[key]
                if rec["decode_s"] is not None:
                    stage["decode_s"] += rec["decode_s"]
                    decode_known = True
                metrics.add_rows(ok=rec["ok"], error=rec["errors"], engine_calls=int(round(rec["engine_calls"])),
                                 carried=rec["carried"])
            listed, _, _ = ray.get(counter.get.remote())
            metrics.set_listed(listed)
            if progress is not None:
                progress(done, listed, totals["error"])
        listed, skipped, list_s = ray.get(counter.get.remote())
    finally:
        metrics.close()
        ray.kill(counter)
    if progress is not None:
        progress(done, listed, totals["error"])

    finished_at = datetime.now(timezone.utc)
    elapsed = time.perf_counter() - t0
    counts = {"ok": totals["ok"], "error": totals["error"]}
    classified = done - totals["carried"]
    stats = {
        "counts": counts,
        "error_kinds": dict(kinds),
        "images": done,
        "classified": classified,
        "carried": totals["carried"],
        "already_done": skipped,
        "elapsed_s": elapsed,
        "stage_seconds": {
            "list": list_prep_s + list_s,
            "fetch": stage["fetch_s"],
            "decode_preprocess": stage["decode_s"] if decode_known else None,
            "infer": stage["infer_s"],
            "write": stage["write_s"],
        },
        "engine_calls": stage["engine_calls"],
        "model": bundle.name,
        "engine": config.engine,
        "started_at": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
    }
    from pipeline.quality import quality_of_parts
    from pipeline.report import build_run_report

    report = build_run_report(stats)
    report["quality"] = quality_of_parts(dst_fs, committed_parts(dst_fs, dst_root))  # every committed row
    write_json(dst_fs, dst_root, REPORT, report)
    all_counts = _count_output(dst_fs, dst_root)
    write_json(dst_fs, dst_root, SUCCESS, {
        "counts": all_counts,
        "rows": sum(all_counts.values()),
        "this_run": {"images": done, "classified": classified, "carried": totals["carried"], "already_done": skipped},
        "model": bundle.name,
        "options": config.public_dict(),
        "started_at": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
    })
    return RunSummary(
        output=config.output,
        counts=all_counts,
        total=sum(all_counts.values()),
        classified=classified,
        carried=totals["carried"],
        already_done=skipped,
        elapsed_s=elapsed,
        report=report,
        nothing_to_do=done == 0,
    )


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


def _init_ray() -> None:
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


def _build_dataset(config: RunConfig, skip_keys: np.ndarray, previous_ref: Any, counter: Any):
    import ray
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    from pipeline.actor import ClassifyActor
    from pipeline.fetch import fetch_batch
    from pipeline.writer import write_shard

    cpus = int(ray.cluster_resources().get("CPU", 1))
    gpus = int(ray.cluster_resources().get("GPU", 0))
    gpu_engine = config.engine in ("gpu", "triton") and gpus > 0
    num_gpus = config.num_gpus_per_actor if config.num_gpus_per_actor is not None else (1.0 if gpu_engine else 0.0)
    if config.num_actors is not None:
        actors = config.num_actors
    elif num_gpus:
        actors = max(1, int(gpus / num_gpus))
    else:
        actors = max(1, cpus // 4)
    # Leave CPU for the listing, fetch and write tasks, or a pool that takes every CPU deadlocks the job.
    actor_cpus = 1.0 if actors < cpus else max(0.25, (cpus - 3 * IO_TASK_CPUS) / actors)
    listing = ListingDatasource(config.source, config.storage_options, config.extensions, skip_keys=skip_keys,
                                previous=previous_ref, counter=counter)
    ds = ray.data.read_datasource(listing, override_num_blocks=max(2, cpus), num_cpus=IO_TASK_CPUS)
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
        compute=ActorPoolStrategy(size=actors),
        # Ray Data's actor pool restarts dead actors and retries their tasks by default (max_restarts=-1).
        num_cpus=actor_cpus,
        num_gpus=num_gpus or None,
    )
    ds = ds.map_batches(
        write_shard,
        fn_kwargs={"output": config.output, "storage_options": config.storage_options},
        batch_size=config.shard_size,
        batch_format="pyarrow",
        num_cpus=IO_TASK_CPUS,
        compute=TaskPoolStrategy(size=max(1, cpus // 8)),
    )
    return ds


def _prepare_output(fs: Any, root: str, config: RunConfig) -> None:
    try:
        if fs.exists(root) and fs.info(root).get("type") == "file":
            raise OutputError(f"--output {config.output!r} is a file; give a folder or prefix")
        fs.makedirs(root, exist_ok=True)
        if config.overwrite:
            _remove_owned(fs, root)
        probe = f"{root.rstrip('/')}/_probe.{os.getpid()}"
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
        # A run in progress is not a completed run: _SUCCESS comes back when this one completes.
        success = f"{root.rstrip('/')}/{SUCCESS}"
        if fs.exists(success):
            fs.rm_file(success)
    except OutputError:
        raise
    except Exception as err:  # noqa: BLE001
        raise OutputError(storage_failure(config.output, err).replace("cannot read", "cannot write")) from None


def _remove_owned(fs: Any, root: str) -> None:
    """--overwrite: delete this tool's files directly in DEST, never anything else."""
    for path in fs.ls(root, detail=False):
        if path.rsplit("/", 1)[-1].startswith(OWNED_PREFIXES):
            fs.rm_file(path)


def _check_compatible(fs: Any, root: str, config: RunConfig, model_name: str) -> None:
    info = read_json(fs, root, RUN_INFO)
    if not info or config.overwrite:
        return
    if info.get("model") != model_name or info.get("top_k") != config.top_k:
        raise OutputError(
            f"--output {config.output!r} holds rows of model {info.get('model')!r} top-k {info.get('top_k')}, "
            f"not {model_name!r} top-k {config.top_k}; pass --overwrite to start over or choose another --output"
        )


def _load_previous(config: RunConfig, model_name: str) -> pa.Table | None:
    fs, root = open_fs(config.previous, config.storage_options)
    parts = committed_parts(fs, root)
    if not parts:
        raise OutputError(f"--previous {config.previous!r} holds no committed output; drop the option or fix the URL")
    table = read_columns(fs, parts, OUTPUT_SCHEMA.names)
    # Carry only rows this run would have produced itself: same model and top-k, and not an error
    # (errors are retried: storage or a bad upload may have been fixed since).
    mask = [s == "ok" and m == model_name and len(c or []) == config.top_k for s, m, c in zip(
        table.column("status").to_pylist(), table.column("model").to_pylist(), table.column("class_ids").to_pylist())]
    table = table.filter(pa.array(mask, pa.bool_()))
    keys = [identity_hash(u, e, s, mtime_us(m)) for u, e, s, m in zip(
        table.column("uri").to_pylist(), table.column("etag").to_pylist(),
        table.column("size_bytes").to_pylist(), table.column("mtime").to_pylist())]
    table = table.append_column("_identity", pa.array(keys, pa.int64()))
    table = table.sort_by("_identity")
    LOG.info("previous run %s: %d rows can be carried over", config.previous, table.num_rows)
    return table


def _count_output(fs: Any, root: str) -> dict[str, int]:
    statuses = read_columns(fs, committed_parts(fs, root), ["status"]).column("status").to_pylist()
    counts = Counter(statuses)
    return {"ok": counts.get("ok", 0), "error": counts.get("error", 0)}


__all__ = ["RunSummary", "run_job", "SUCCESS", "REPORT", "ModelError"]
