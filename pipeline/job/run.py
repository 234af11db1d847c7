"""The story of a run: check, read what is done, classify what is new, carry what is unchanged, report."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from pipeline.config import RunConfig
from pipeline.job.output import (
    OutputIndex, RecordCounter, check_compatible, index_output, prepare_output, read_previous,
)
from pipeline.schema import REPORT, RUN_INFO, SUCCESS
from pipeline.source import check_source, open_fs
from pipeline.stats import ShardStats
from pipeline.writer import write_json

LOG = logging.getLogger(__name__)
ProgressCallback = Callable[[int, "int | None", int], None]
PROGRESS_S = 0.5  # how often the driver asks the listing counter for the listed total while draining


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


def run_job(config: RunConfig, *, progress: ProgressCallback | None = None) -> RunSummary:
    """Classify every image under ``config.source`` that has no committed row in ``config.output``.

    Raises ``ConfigError``/``SourceError``/``OutputError``/``ModelError`` before any work when the
    arguments, storage or model are unusable. Bad images become error rows and never raise.
    """
    config.check_requirements()  # the engine's preflight: before anything is written or Ray starts
    started_at = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    src_fs, src_root = open_fs(config.source, config.storage_options)
    check_source(src_fs, src_root, config.source)
    dst_fs, dst_root = open_fs(config.output, config.storage_options)
    prepare_output(dst_fs, dst_root, config)

    from pipeline.model import load_model

    bundle = load_model(config.model)  # fail fast (and build the cache once) before any actor starts
    check_compatible(dst_fs, dst_root, config, bundle.name)
    write_json(dst_fs, dst_root, RUN_INFO, {"model": bundle.name, "top_k": config.top_k, "engine": config.engine,
                                            "started_at": started_at.isoformat()})

    t_index = time.perf_counter()
    done = index_output(dst_fs, dst_root)  # resume: the uri hashes of committed rows, from shard records
    previous = read_previous(config, bundle.name) if config.previous else None
    index_s = time.perf_counter() - t_index

    run = _Run(config, progress)
    try:
        totals, listed, skipped, list_s = run.classify_and_carry(done, previous)
    finally:
        run.close()

    finished_at = datetime.now(timezone.utc)
    elapsed = time.perf_counter() - t0
    report = assemble_report(config, totals, model=bundle.name, already_done=skipped, list_s=index_s + list_s,
                             elapsed_s=elapsed, started_at=started_at, finished_at=finished_at)
    from pipeline.quality import committed_quality

    counter = RecordCounter(dst_fs)
    # every committed row, shard by shard; the final counts come from the same footers, read once
    report["quality"] = committed_quality(dst_fs, dst_root, on_footer=counter)
    write_json(dst_fs, dst_root, REPORT, report)
    all_counts = counter.counts
    write_json(dst_fs, dst_root, SUCCESS, {
        "counts": all_counts,
        "rows": sum(all_counts.values()),
        "this_run": {"images": totals.rows, "classified": totals.classified, "carried": totals.carried,
                     "already_done": skipped},
        "model": bundle.name,
        "options": config.public_dict(),
        "started_at": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
    })
    return RunSummary(output=config.output, counts=all_counts, total=sum(all_counts.values()),
                      classified=totals.classified, carried=totals.carried, already_done=skipped,
                      elapsed_s=elapsed, report=report)


def assemble_report(config: RunConfig, totals: ShardStats, *, model: str, already_done: int, list_s: float,
                    elapsed_s: float, started_at: datetime, finished_at: datetime) -> dict[str, Any]:
    """The run report written to ``_REPORT.json``: this run's totals, stage times and identity."""
    from pipeline.report import build_run_report

    return build_run_report({
        **totals.report_fields(),
        "already_done": already_done,
        "elapsed_s": elapsed_s,
        "stage_seconds": totals.stage_seconds(list_s),
        "model": model,
        "engine": config.engine,
        "started_at": started_at.isoformat(),
        "finished_at": finished_at.isoformat(),
    })


class _Run:
    """The Ray part of a run: the listing counter, the metrics endpoint, and draining the two pipelines."""

    def __init__(self, config: RunConfig, progress: ProgressCallback | None):
        import ray

        from pipeline.job.stages import init_ray
        from pipeline.listing_counter import ListingCounter
        from pipeline.metrics import JobMetrics

        self.config, self.progress = config, progress
        init_ray(config)
        self.counter = ray.remote(num_cpus=0)(ListingCounter).remote()
        self.metrics = JobMetrics(config.metrics_port)
        self.totals = ShardStats()

    def classify_and_carry(self, done: OutputIndex, previous: OutputIndex | None) -> tuple[ShardStats, int, int,
                                                                                           float]:
        """Phase 1 classifies what is new or changed while the listing streams; phase 2 copies the unchanged."""
        import ray

        from pipeline.job.stages import carry_dataset, classify_dataset

        # The key sets go to the object store once; listing and carry tasks map them without copying.
        done_ref = ray.put(done.uri_hashes)
        previous_ref = ray.put(previous.identities) if previous is not None and previous.identities.size else None
        done.uri_hashes = None  # the driver keeps no copy
        if previous is not None:
            previous.identities = None
        start = time.perf_counter()
        self._drain(classify_dataset(self.config, done_ref, previous_ref, self.counter))
        listed, skipped, list_s = ray.get(self.counter.get.remote())
        LOG.info("listed %d objects (%d already done), classified %d rows in %.1f s", listed, skipped,
                 self.totals.rows, time.perf_counter() - start)
        if previous_ref is not None:
            start = time.perf_counter()
            carried_ref = self.counter.carried_keys.remote()
            self._drain(carry_dataset(self.config, previous.parts, carried_ref))
            LOG.info("carried %d rows over in %.1f s", self.totals.carried, time.perf_counter() - start)
        self._report_progress(listed)
        return self.totals, listed, skipped, list_s

    def _drain(self, ds: Any) -> None:
        import ray

        listed, asked = 0, 0.0
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for shard in ShardStats.from_table(batch):
                self.totals += shard
                self.metrics.add_shard(shard)
            # A carry-over yields a batch per shard (1,000 per million rows): ask the counter actor for the listed
            # total at most every PROGRESS_S, not once per batch (each ask is a round trip the driver waits on).
            if time.monotonic() - asked >= PROGRESS_S:
                listed, _, _ = ray.get(self.counter.get.remote())
                asked = time.monotonic()
            self._report_progress(listed)

    def _report_progress(self, listed: int) -> None:
        self.metrics.set_listed(listed)
        if self.progress is not None:
            self.progress(self.totals.rows, listed, self.totals.errors)

    def close(self) -> None:
        import ray

        self.metrics.close()
        ray.kill(self.counter)
