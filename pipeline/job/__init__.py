"""Wiring the job: listing → fetch → classify (actor pool) → atomic Parquet shards, resumable, with a report.

``run`` tells the story of a run; ``output`` prepares DEST and reads the resume and carry-over sets from shard
records (no Ray); ``local_ray`` marks the local Ray we start and sweeps what dead runs left;
``stages`` builds the Ray Data pipeline and the carry tasks (the only module here that imports Ray at the top).
"""

from pipeline.job.run import RunSummary, run_job


__all__ = ["RunSummary", "run_job"]
