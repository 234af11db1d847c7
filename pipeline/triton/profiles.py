"""How the triton engine serves each repository profile: the server's shape and the client's feed, in one place.

``--engine triton`` picks the profile by the actor's device (``choose_profile``): the gpu profile where the actor
has a GPU, the portable one elsewhere. Each default below is measured; docs/performance.md has the figures and
the commands that reproduce them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.errors import ConfigError
from pipeline.node import node_gpus
from pipeline.schema import MIB

AUTO = "auto"
PORTABLE = "portable"
GPU = "gpu"
PRODUCTION = "production"  # TensorRT behind DALI, built per GPU by `repo prepare`; the engine does not serve it


@dataclass(frozen=True)
class ServingProfile:
    """One profile as the engine serves it.

    Attributes:
        name: the repository profile (``bulk-classify repo build --profile``).
        needs_gpu: served only where the actor has a GPU.
        instances: model instances in the server.
        set_instances: model instances in the server of a model set (each instance runs every model's network in
            turn, so more of them keep the GPU's queue full while others decode).
        max_backlog: network batches one gpu-profile instance takes before its execute() waits (None: the
            profile has no stream).
        request_batch: images per request.
        concurrency: requests in flight per engine (Little's law: enough to keep the server's queue full at its
            rate for its latency).
        share_server: the actors of one GPU share one server (its one CUDA context keeps the GPU, their client
            processes spread the gRPC work over several cores).
        mps: start a private CUDA MPS daemon for the server (pipeline.triton.mps), so the instances' kernels overlap.
        shm_bytes: the python backend's first shared-memory region and its growth step per stub; a region that
            starts at 1 MiB and grows 1 MiB at a time is re-mapped many times for requests of several MiB.
    """

    name: str
    needs_gpu: bool
    instances: int
    max_backlog: float | None
    request_batch: int
    concurrency: int
    share_server: bool
    mps: bool
    shm_bytes: tuple[int, int] | None = None
    set_instances: int | None = None  # None: ``instances``

    def instances_for(self, models: int) -> int:
        """The instances this profile serves ``models`` models (one, or a model set's) with."""
        return self.set_instances if models > 1 and self.set_instances else self.instances

    def server_args(self) -> list[str]:
        """tritonserver arguments this profile is served with."""
        return [f"--backend-config=python,shm-{role}-byte-size={size}"
                for role, size in zip(("default", "growth"), self.shm_bytes or ())]


PROFILES: dict[str, ServingProfile] = {
    p.name: p
    for p in (
        # ONNX Runtime on the CPU inside the server: one instance, small requests, two in flight.
        ServingProfile(name=PORTABLE, needs_gpu=False, instances=1, max_backlog=None, request_batch=32,
                       concurrency=2, share_server=False, mps=False),
        # DALI + the CUDA-graph network: the instances under MPS that give the whole job its best rate and wall
        # time (docs/performance.md); the requests in flight of the actors sharing the server keep every instance fed.
        # A model set gets six: more than four gave its pair a higher rate, eight none (docs/performance.md).
        ServingProfile(name=GPU, needs_gpu=True, instances=4, max_backlog=4, request_batch=128, concurrency=16,
                       share_server=True, mps=True, shm_bytes=(256 * MIB, 64 * MIB), set_instances=6),
    )
}
PROFILE_CHOICES = (AUTO, *PROFILES)


def visible_gpus() -> list[str]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` (Ray sets it for every actor), else the node's."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    return [str(i) for i in range(node_gpus())]


def choose_profile(profile: str) -> ServingProfile:
    """``profile``'s serving shape; ``auto`` is the gpu profile where this process has a GPU, else portable."""
    if profile == AUTO:
        profile = GPU if visible_gpus() else PORTABLE
    if profile not in PROFILES:
        raise ConfigError(f"--engine-option profile={profile!r} is unknown; use {', '.join(PROFILE_CHOICES)}")
    return PROFILES[profile]
