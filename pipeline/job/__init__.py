"""Wiring the job: listing → fetch → classify (actor pool) → atomic Parquet shards, resumable, with a report.

``run`` tells the story of a run; ``plan`` decides once what the run is (the engine and its parsed options, the model
checked, local Ray or a cluster, the opened stores); ``output`` prepares DEST and reads the resume and carry-over sets from shard records (no Ray);
``local_ray`` marks a local Ray we start and sweeps what dead runs left; ``stages`` decides the
actors' shares of the cluster once Ray is up, and builds the Ray Data pipeline and the carry tasks.
"""

from pipeline.job.output import open_store
from pipeline.job.plan import RunPlan, choose_engine, make_plan
from pipeline.job.run import RunSummary, run_job


__all__ = ["RunPlan", "RunSummary", "choose_engine", "make_plan", "open_store", "run_job"]
