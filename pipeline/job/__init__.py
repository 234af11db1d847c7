"""Wiring the job: listing → fetch → classify (actor pool) → atomic Parquet shards, resumable, with a report.

``run`` tells the story of a run; ``plan`` decides once what the run is (the engine, the stores, the actors' shares
of the cluster); ``output`` prepares DEST and reads the resume and carry-over sets from shard records (no Ray);
``local_ray`` owns the environment of a local Ray we start and sweeps what dead runs left; ``stages`` builds the Ray
Data pipeline and the carry tasks.
"""

from pipeline.job.local_ray import local_ray_env
from pipeline.job.plan import RunPlan, make_plan
from pipeline.job.run import RunSummary, run_job


__all__ = ["RunPlan", "RunSummary", "make_plan", "run_job", "local_ray_env"]
