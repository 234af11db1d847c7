"""``--engine auto``, the default: a local Triton per GPU serving DALI + the CUDA-graph network (the triton engine's
gpu profile) where the Ray cluster has GPUs, onnx elsewhere.

The choice is made once in the driver, before anything is written, from the GPUs Ray will schedule on: this
machine's (as Ray counts them) for a local Ray, the cluster's resources with ``RAY_ADDRESS``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pipeline.gpu.defaults import GPU_EXTRA_HINT, missing_gpu_stack
from pipeline.node import local_ray_env, node_gpus, ray_address

LOG = logging.getLogger(__name__)

AUTO_ENGINE = "auto"
# The product's GPU path: the triton engine serves the gpu profile on a GPU actor (docs/performance.md compares it
# with the in-process gpu engine).
GPU_CHOICE = "triton"
CPU_CHOICE = "onnx"


@dataclass(frozen=True)
class Choice:
    """What ``auto`` resolves to, and why, in words a user reads in ``bulk-classify engines``."""

    engine: str
    gpus: int
    reason: str


def cluster_gpus(address: str | None) -> tuple[int, str]:
    """(GPUs, where they were counted): the cluster's at ``address`` (Ray is connected for it), else (None) this
    machine's as a local Ray would count them."""
    if address is None:
        local_ray_env()  # counting GPUs imports ray: the loopback switch must be set first
        return node_gpus(), "this machine"
    import ray  # noqa: PLC0415

    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=True)
    return int(ray.cluster_resources().get("GPU", 0)), f"the Ray cluster at {address}"


def choose(gpus: int | None = None, where: str = "this machine") -> Choice:
    """The engine ``auto`` runs: GPU_CHOICE on a cluster with GPUs (whose driver has the GPU stack, when the
    cluster is this machine), onnx elsewhere."""
    if gpus is None:
        gpus, where = cluster_gpus(ray_address())
    if gpus <= 0:
        return Choice(CPU_CHOICE, 0, f"{where} has no GPU that Ray can use")
    if where == "this machine":
        missing = missing_gpu_stack()
        if missing:
            LOG.warning("%d GPU(s) here but no %s: classifying on the CPU; %s for the GPU path", gpus,
                        " or ".join(missing), GPU_EXTRA_HINT)
            return Choice(CPU_CHOICE, gpus, f"{where} has {gpus} GPU(s) but no {' or '.join(missing)} "
                                            f"({GPU_EXTRA_HINT})")
    return Choice(GPU_CHOICE, gpus, f"{where} has {gpus} GPU(s): a local Triton per GPU serving DALI and the network "
                                    "(the gpu profile; --engine gpu runs the same in the actor's process)")
