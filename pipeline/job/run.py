"""The story of a run: check, read what is done, classify what is new, carry what is unchanged, report."""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable

from pipeline.config import RunConfig
from pipeline.errors import LIST_ERROR
from pipeline.io.iceberg_output import IcebergOutput
from pipeline.io.reader import committed_parts
from pipeline.io.source_manifest import planned_entries
from pipeline.io.stats import ShardStats
from pipeline.io.writer import write_json
from pipeline.job.lease import Lease
from pipeline.job.local_ray import ray_owned
from pipeline.job.output import (
    OutputIndex, RecordCounter, begin_output, dedupe_output, excluded_prefix, index_output,
    read_previous, storage_errors, without_folder,
)
from pipeline.job.plan import RunPlan, make_plan
from pipeline.job.stages import Shares, count_cluster, plan_shares
from pipeline.schema import REPORT, SUCCESS

if TYPE_CHECKING:
    from pipeline.model.folder import ModelBundle
    from pipeline.model.model_set import ModelSet

LOG = logging.getLogger(__name__)
ProgressCallback = Callable[[int, "int | None", int], None]
PROGRESS_S = 0.5  # how often the driver asks the listing counter for the listed total while draining
DRIVER_WRITE_THREADS = 2  # shards a driver that writes (no writer actors) commits at once


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


def run_job(config: RunConfig | RunPlan, *, progress: ProgressCallback | None = None) -> RunSummary:
    """Classify every image under ``config.source`` that has no committed row in ``config.output``.

    ``config`` may be a plan ``make_plan`` already made of it. Raises ``ConfigError``/``SourceError``/
    ``OutputError``/``ModelError`` before any work when the arguments, storage or model are unusable. Bad images
    become error rows and never raise. The Ray the run starts (or joins) is shut down when it ends; a Ray that was
    already up is left running.
    """
    with ray_owned():
        return _run_job(config, progress)


def _run_job(config: RunConfig | RunPlan, progress: ProgressCallback | None) -> RunSummary:
    started_at = datetime.now(timezone.utc)
    t0 = time.perf_counter()  # elapsed_s counts the checks too: on a GPU node resolving auto imports Ray
    # Every check reads only: DEST is changed first by the lease, and only once all of them (the plan's) have passed.
    plan = config if isinstance(config, RunPlan) else make_plan(config)
    config, bundle, out = plan.config, plan.identity, plan.output
    dst_fs, dst_root = out.fs, out.root
    t_index = time.perf_counter()
    previous = read_previous(plan.previous, bundle, config.top_k, plan.previous_parts) if plan.previous else None
    with storage_errors(config.output, dst_root):
        lease = Lease(dst_fs, dst_root, config.output).acquire()
    try:
        with storage_errors(config.output, dst_root):
            begin_output(dst_fs, dst_root, {"model": bundle.name, "model_digest": bundle.digest,
                                            "top_k": config.top_k, "engine": config.engine,
                                            "started_at": started_at.isoformat()}, overwrite=config.overwrite)
            done = index_output(dst_fs, dst_root)  # resume: the uri hashes of committed rows, from shard records
        index_s = time.perf_counter() - t_index
        run = _Run(plan, progress)
        try:
            try:
                with storage_errors(config.output, dst_root):
                    totals, listed, skipped, list_s = run.classify_and_carry(done, previous,
                                                                             excluded_prefix(plan.source, out))
            finally:
                run.close()
            with storage_errors(config.output, dst_root):
                dedupe_output(dst_fs, dst_root, config.output)  # every URI's row unique, before a table commit and the counts
                if plan.table is not None:
                    commit_table(plan.table, dst_fs, dst_root, lease, {
                        "model": bundle.name, "model-digest": bundle.digest, "started-at": started_at.isoformat()})
                return _finish(plan, lease, totals, skipped, started_at, t0, index_s + list_s, run.writer_actors)
        finally:
            run.wait_closed()  # the node's servers stop while the output is finished
    finally:
        lease.release()


def commit_table(table: IcebergOutput, fs: Any, root: str, lease: Lease, run: dict[str, str]) -> None:
    """Commit the data folder's shards that the table lacks (every URI's row already unique), under the lease."""
    lease.check()
    table.commit(fs, committed_parts(fs, root), run)


def start_node(plan: RunPlan) -> Any:
    """What the engine starts in the driver of a local Ray for the node's actors (``EngineSpec.node_start``: the
    triton engine's shared servers), begun before Ray starts; None for most engines."""
    from pipeline.model.imaging import DecodeLimits

    config = plan.config
    return plan.spec.start_node(
        plan.bundle, top_k=config.top_k, limits=DecodeLimits(max_bytes=config.max_bytes, max_pixels=config.max_pixels),
        options=plan.engine_options, more=plan.more)


def _finish(plan: RunPlan, lease: Lease, totals: ShardStats, skipped: int, started_at: datetime, t0: float,
            list_s: float, writer_actors: int) -> RunSummary:
    """Count the committed rows (each URI's row already unique) and write ``_REPORT.json`` and then ``_SUCCESS``."""
    finished_at = datetime.now(timezone.utc)
    elapsed = time.perf_counter() - t0
    dst_fs, dst_root, bundle = plan.output.fs, plan.output.root, plan.identity
    report = assemble_report(plan.config.engine, totals, bundle=bundle, already_done=skipped, list_s=list_s,
                             elapsed_s=elapsed, started_at=started_at, finished_at=finished_at,
                             writer_actors=writer_actors)
    from pipeline.quality.statistics import committed_quality

    counter = RecordCounter(dst_fs)
    # every committed row, shard by shard; the final counts come from the same footers, read once
    report["quality"] = committed_quality(dst_fs, dst_root, on_footer=counter)
    lease.check()
    write_json(dst_fs, dst_root, REPORT, report)
    all_counts = counter.counts
    write_json(dst_fs, dst_root, SUCCESS, {
        "counts": all_counts,
        "rows": sum(all_counts.values()),
        "list_errors": report["quality"]["error_kinds"].get(LIST_ERROR, 0),  # folders or links not listed
        "this_run": {"images": totals.rows, "classified": totals.classified, "carried": totals.carried,
                     "already_done": skipped},
        "model": bundle.name,
        "model_digest": bundle.digest,
        "options": plan.config.public_dict(),
        "started_at": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
    })
    return RunSummary(output=plan.output_url, counts=all_counts, total=sum(all_counts.values()),
                      classified=totals.classified, carried=totals.carried, already_done=skipped,
                      elapsed_s=elapsed, report=report)


def assemble_report(engine: str, totals: ShardStats, *, bundle: ModelBundle | ModelSet, already_done: int,
                    list_s: float, elapsed_s: float, started_at: datetime, finished_at: datetime,
                    writer_actors: int = 0) -> dict[str, Any]:
    """The run report written to ``_REPORT.json``: this run's totals, stage times and identity (``engine``: the
    resolved engine's name)."""
    from pipeline.quality.report import build_run_report

    return build_run_report({
        **totals.report_fields(),
        "already_done": already_done,
        "elapsed_s": elapsed_s,
        "stage_seconds": totals.stage_seconds(list_s),
        "model": bundle.name,
        "model_digest": bundle.digest,
        "engine": engine,
        "writer_actors": writer_actors,
        "started_at": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
    })


class _Run:
    """The Ray part of a run: the listing counter, the metrics endpoint, the classify pipeline and the carry tasks."""

    def __init__(self, plan: RunPlan, progress: ProgressCallback | None):
        from pipeline.job.stages import init_ray, limit_fetch_ahead
        from pipeline.metrics import JobMetrics

        self.plan, self.config, self.progress, self.bundle = plan, plan.config, progress, plan.identity
        self.node = start_node(plan) if plan.local else None
        self._node_closing = False
        try:
            init_ray(plan)
            self.shares: Shares = plan_shares(plan, *count_cluster())  # the cluster, asked once
            limit_fetch_ahead(self.shares.fetch_ahead_bytes)
        except BaseException:
            self.wait_closed()
            raise
        self.counter: Any = None
        self.writer_actors = 0  # the pipeline's writer actors; none: the driver commits the shards
        self.carrying: list[Any] = []  # refs of carry tasks not yet collected
        self.metrics = JobMetrics(plan.config.metrics_port)
        self.totals = ShardStats()
        self.listed, self.asked = 0, 0.0
        self.planned: int | None = None  # a manifest's entries not yet done, known from its footers before listing

    def classify_and_carry(self, done: OutputIndex, previous: OutputIndex | None, excluded: str | None = None
                           ) -> tuple[ShardStats, int, int, float]:
        """Classify what is new or changed while the listing streams; copy the unchanged from the end of the listing.

        The carry tasks wait only for the listing (the identities it matched), not for the classification: they
        run beside the fetch, classify and write tasks, and the driver collects both.
        """
        import ray

        from pipeline.job.stages import carry_tasks, classify_dataset, listing_groups
        from pipeline.io.listing_counter import ListingCounter

        groups = without_folder(listing_groups(self.plan, self.shares), excluded)
        planned = planned_entries(groups)
        self.planned = None if planned is None else max(0, planned - done.rows)
        self.counter = ray.remote(num_cpus=0)(ListingCounter).remote(len(groups))
        # The key sets go to the object store once; listing and carry tasks map them without copying.
        done_ref = ray.put(done.uri_hashes)
        previous_ref = ray.put(previous.identities) if previous is not None and previous.identities.size else None
        done.uri_hashes = None  # the driver keeps no copy
        if previous is not None:
            previous.identities = None
        start = time.perf_counter()
        if previous_ref is not None:
            self.carrying = carry_tasks(self.plan, self.shares, previous.parts, self.counter.carried_keys.remote(),
                                        model_digest=self.bundle.digest)
        ds = classify_dataset(self.plan, self.shares, groups, done_ref, previous_ref, self.counter, excluded,
                              model_digest=self.bundle.digest)
        self.writer_actors = self.shares.writer_actors
        self._drain(ds, writes=not self.writer_actors)
        listed, skipped, list_s = ray.get(self.counter.get.remote())
        LOG.info("listed %d objects (%d already done), classified %d rows in %.1f s", listed, skipped,
                 self.totals.classified, time.perf_counter() - start)
        while self.carrying:
            self._collect(timeout_s=PROGRESS_S)
            self._report_progress()
        if previous_ref is not None:
            LOG.info("carried %d rows over, done %.1f s after the listing started", self.totals.carried,
                     time.perf_counter() - start)
        self.listed = listed
        self._report_progress(ask=False)
        self._close_node()
        return self.totals, listed, skipped, list_s

    def _close_node(self) -> None:
        """Stops, in the background, what the driver started for the node's actors, once they are done, and counts
        its events (server starts) in the run's; ``wait_closed()`` waits for it."""
        if self.node is not None and not self._node_closing:
            self._node_closing = True
            self.node.close(wait=False)
            self.totals += ShardStats(engine_events={k: v for k, v in self.node.events.items() if v})

    def wait_closed(self) -> None:
        if self.node is not None:
            self.node.close()
            self.node = None

    def _drain(self, ds: Any, *, writes: bool) -> None:
        """Take the pipeline's output: the writers' shard stats or, where the driver ``writes``, the classified rows,
        committed here in shards of ``shard_size`` on DRIVER_WRITE_THREADS threads while the next batch arrives."""
        from pipeline.quality.statistics import quality_footer
        from pipeline.io.writer import write_shard

        with ThreadPoolExecutor(DRIVER_WRITE_THREADS, thread_name_prefix="write") as pool:
            writing: deque[Future] = deque()
            batches = ds.iter_batches(batch_size=self.config.shard_size if writes else None, batch_format="pyarrow")
            for batch in batches:
                if not writes:
                    self._add(batch)
                else:
                    writing.append(pool.submit(write_shard, batch, store=(self.plan.output.fs, self.plan.output.root),
                                               footer=quality_footer))
                    while writing and (writing[0].done() or len(writing) > DRIVER_WRITE_THREADS):
                        self._add(writing.popleft().result())
                if self.carrying:
                    self._collect(timeout_s=0)
                self._report_progress()
            while writing:
                self._add(writing.popleft().result())

    def _collect(self, timeout_s: float) -> None:
        """Add the results of the carry tasks that have finished (waiting up to ``timeout_s`` for one)."""
        import ray

        ready, self.carrying = ray.wait(self.carrying, num_returns=1, timeout=timeout_s)
        if ready:
            more, self.carrying = ray.wait(self.carrying, num_returns=len(self.carrying), timeout=0) \
                if self.carrying else ([], [])
            for table in ray.get(ready + more):
                self._add(table)

    def _add(self, table: Any) -> None:
        for shard in ShardStats.from_table(table):
            self.totals += shard
            self.metrics.add_shard(shard)

    def _report_progress(self, ask: bool = True) -> None:
        import ray

        # Ask the counter actor for the listed total at most every PROGRESS_S, not once per batch (each ask is a
        # round trip the driver waits on).
        if ask and self.counter is not None and time.monotonic() - self.asked >= PROGRESS_S:
            if self.planned is None:
                self.listed, _, _ = ray.get(self.counter.get.remote())
            else:
                self.listed, finished = ray.get(self.counter.progress.remote())
                self.planned = None if finished else self.planned
            self.asked = time.monotonic()
        self.metrics.set_listed(self.listed)
        if self.progress is not None:
            # While a manifest is being listed, the total is its count from the footers (before filtering).
            total = self.listed if self.planned is None else max(self.listed, self.planned)
            self.progress(self.totals.rows, total, self.totals.errors)

    def close(self) -> None:
        import ray

        self._close_node()
        self.metrics.close()
        for ref in self.carrying:  # a run that failed: the carry tasks still waiting need not start
            ray.cancel(ref)
        if self.counter is not None:
            ray.kill(self.counter)
