"""This node: its loopback address, the GPUs a local Ray counts on it, whether a process still runs, whether a module
is installed, the Ray cluster the job joins (this module is the one reader of ``RAY_ADDRESS``), and the environment
of a local Ray we start."""

from __future__ import annotations

import importlib.util
import os

LOOPBACK = "127.0.0.1"
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


# Set by a driver run with -v for the local Ray it starts: the workers (actors, tritonserver's stubs) log INFO too, so
# that what their start took is in the run's log.
VERBOSE_ENV = "BULK_CLASSIFY_VERBOSE"


def follow_driver_logging() -> None:
    """In a worker: the package's INFO lines to stderr (which Ray sends to the driver) where the driver asked for them
    (``VERBOSE_ENV``)."""
    if os.environ.get(VERBOSE_ENV) != "1":
        return
    import logging  # noqa: PLC0415

    logger = logging.getLogger("pipeline")
    if logger.level != logging.INFO:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def pid_alive(pid: int, started: float | None = None) -> bool:
    """Is ``pid`` a running process (and, given its start time, the same process, not a reused pid)? A zombie (exited,
    not yet reaped) is not; one we may not inspect is."""
    import psutil  # noqa: PLC0415

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and (started is None or abs(proc.create_time() - started) < 1.0)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def node_gpus() -> int:
    """GPUs on this node as Ray counts them when it starts here (0 without Ray, a driver or a GPU): the node's, at
    most as many as ``CUDA_VISIBLE_DEVICES`` names (``""`` hides them all)."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource  # noqa: PLC0415
    except ImportError:
        return 0
    try:
        manager = get_accelerator_manager_for_resource("GPU")
        count = int(manager.get_current_node_num_accelerators() or 0)
        visible = manager.get_current_process_visible_accelerator_ids()
    except Exception:  # noqa: BLE001 - no driver, no NVML: no GPU to use
        return 0
    return count if visible is None else min(count, len(visible))


def importable(module: str) -> bool:
    """Whether ``module`` can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package (``nvidia``) is missing
        return False
