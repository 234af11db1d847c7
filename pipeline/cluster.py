"""Where the job's Ray runs: the cluster ``RAY_ADDRESS`` names (this module is the one reader of it), or a local Ray
the job starts, and that local Ray's environment."""

from __future__ import annotations

import os

RAY_ADDRESS_ENV = "RAY_ADDRESS"
# Ray's own metrics collection runs a periodic OpenTelemetry export thread in every
# worker; on Ray 2.60 it crashed a worker with SIGSEGV inside
# TemporalMetricStorage::buildMetrics (seen in CI, killing an actor mid-job). A local
# Ray we start ourselves has no dashboard to read those metrics, so it runs without them.
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is Ray's single-machine switch: the node IP becomes
# 127.0.0.1, so GCS, raylet, workers, agents and the autoscaler/dashboard metrics all
# listen on loopback only (Ray reads it when ray is imported). Set any of them yourself
# to override; a cluster given by RAY_ADDRESS is left as is.
LOCAL_RAY_ENV = {"RAY_enable_metrics_collection": "0", "RAY_enable_open_telemetry": "0",
                 "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def ray_address() -> str | None:
    """The address of the Ray cluster the job joins, or None: the job starts a local Ray on this machine."""
    return os.environ.get(RAY_ADDRESS_ENV) or None


def local_ray_env() -> None:
    """Set the environment a local Ray we start needs (workers inherit it); call before ``import ray``."""
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
