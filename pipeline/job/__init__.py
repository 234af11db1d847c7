"""Wiring the job: listing → fetch → classify (actor pool) → atomic Parquet shards, resumable, with a report.

``run`` tells the story of a run; ``output`` prepares DEST and reads the resume and carry-over sets from shard
records (no Ray); ``stages`` builds the Ray Data pipelines.
"""

from pipeline.job.run import RunSummary, run_job
from pipeline.job.stages import local_ray_env

__all__ = ["RunSummary", "run_job", "local_ray_env"]
