"""Wiring the job: listing → fetch → classify (actor pool) → atomic Parquet shards, resumable, with a report.

``run`` tells the story of a run; ``output`` prepares DEST and reads the resume and carry-over sets from shard
records (no Ray); ``stages`` builds the Ray Data pipeline and the carry tasks (the only module here that imports Ray
at the top).
"""

from pipeline.job.run import RunSummary, run_job


def local_ray_env() -> None:
    """Set the environment a local Ray we start needs (see ``pipeline.job.stages.LOCAL_RAY_ENV``)."""
    from pipeline.job.stages import local_ray_env as set_env

    set_env()


__all__ = ["RunSummary", "run_job", "local_ray_env"]
