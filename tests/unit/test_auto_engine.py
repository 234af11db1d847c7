"""``--engine auto`` and the triton engine's profiles: what each resolves to, by the GPUs there are."""

from __future__ import annotations

import pytest

from pipeline.config import RunConfig
from pipeline.engines import auto
from pipeline.engines.base import DEFAULT_BATCH_SIZE
from pipeline.engines.registry import REGISTRY
from pipeline import node
from pipeline.errors import ConfigError
from pipeline.job.plan import resolve
from pipeline.triton import profiles


def config(**kw) -> RunConfig:
    return RunConfig(**{"source": "in/", "output": "out/", **kw})


def test_auto_is_onnx_without_gpus_and_the_gpu_path_with_them():
    assert auto.choose(0, "this machine") == auto.Choice("onnx", 0, "this machine has no GPU that Ray can use")
    choice = auto.choose(2, "the Ray cluster at ray://head:10001")
    assert (choice.engine, choice.gpus) == ("triton", 2) and REGISTRY[choice.engine].needs_gpu
    assert choice.reason.startswith("the Ray cluster at ray://head:10001 has 2 GPU(s): a local Triton per GPU")


def test_auto_on_a_gpu_machine_without_the_gpu_stack_stays_on_the_cpu(monkeypatch, caplog):
    monkeypatch.setattr(auto, "missing_gpu_stack", lambda: ["nvidia.dali"])
    choice = auto.choose(1, "this machine")
    assert choice.engine == "onnx"
    assert choice.reason == ("this machine has 1 GPU(s) but no nvidia.dali (pip install 'bulk-classify[gpu]' and "
                             "PyTorch with CUDA)")
    assert "classifying on the CPU" in caplog.text
    # a remote cluster's nodes are not this driver: their packages are theirs
    assert auto.choose(1, "the Ray cluster at x").engine == "triton"


def test_this_machine_has_no_gpu_here():
    """The CPU machines that run CI: auto must resolve to onnx, the quick start's engine."""
    assert node.node_gpus() == 0
    assert auto.choose().engine == "onnx"


def test_a_nodes_gpus_are_counted_as_ray_counts_them_within_cuda_visible_devices(monkeypatch):
    """On a GPU node with CUDA_VISIBLE_DEVICES="" Ray schedules no GPU: auto must not pick the GPU path there (it did,
    and actors without a GPU got the portable profile)."""
    from ray._private.accelerators import get_accelerator_manager_for_resource

    manager = get_accelerator_manager_for_resource("GPU")
    monkeypatch.setattr(manager, "get_current_node_num_accelerators", staticmethod(lambda: 2))  # the node's NVML count
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert node.node_gpus() == 2
    for visible, counted in (("", 0), ("1", 1), ("0,1", 2), ("0,1,2", 2)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert node.node_gpus() == counted, visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert auto.choose().engine == "onnx"


def test_a_read_only_array_is_made_exportable_by_dlpack():
    """Under numpy 2 the portable model sends its outputs by DLPack; the echoed TAG is a read-only view of the
    request, which numpy refuses to export (every row was an engine_error on a numpy-2 node)."""
    import numpy as np

    from pipeline.triton.serve.portable_model import dlpack_ready

    echoed = np.frombuffer(np.arange(6, dtype=np.int64).tobytes(), dtype=np.int64).reshape(3, 2)
    assert not echoed.flags.writeable
    with pytest.raises(BufferError, match="readonly"):
        np.from_dlpack(echoed)
    assert np.from_dlpack(dlpack_ready(echoed)).tolist() == echoed.tolist()
    writeable = np.arange(4, dtype=np.float32)
    assert dlpack_ready(writeable) is writeable  # no copy where none is needed


def test_resolve_fills_the_engine_and_the_batch_size_by_the_gpus():
    assert (resolve(config(), 0)[0].engine, resolve(config(), 0)[0].batch_size) == ("onnx", DEFAULT_BATCH_SIZE)
    on_gpus = resolve(config(), 1, "the Ray cluster at x")[0]
    assert (on_gpus.engine, on_gpus.batch_size) == (auto.GPU_CHOICE, REGISTRY[auto.GPU_CHOICE].gpu_batch_size)
    assert resolve(config(engine="triton"), 1, "x")[0].batch_size == REGISTRY["triton"].gpu_batch_size
    assert resolve(config(batch_size=8), 1, "the Ray cluster at x")[0].batch_size == 8  # explicit wins
    assert resolve(config(engine="triton"), 0)[0].batch_size == DEFAULT_BATCH_SIZE  # portable profile, CPU
    assert resolve(config(engine="onnx"), 4)[0].batch_size == DEFAULT_BATCH_SIZE
    assert resolve(config(engine="onnx", batch_size=16), 4)[0] == config(engine="onnx", batch_size=16)  # given as is


def test_engine_options_need_an_engine():
    with pytest.raises(ConfigError, match=r"^--engine-option needs an engine: add --engine onnx or --engine triton"):
        config(engine_options={"max_batch": 8})


@pytest.mark.parametrize("visible, profile", [("", "portable"), ("-1", "portable"), ("0", "gpu"), ("1,2", "gpu")])
def test_triton_serves_the_gpu_profile_where_the_actor_has_a_gpu(monkeypatch, visible, profile):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert profiles.choose_profile("auto").name == profile
    assert profiles.choose_profile("portable").name == "portable"


def test_profiles_carry_their_serving_shape():
    gpu, portable = profiles.PROFILES["gpu"], profiles.PROFILES["portable"]
    assert gpu.server_args() == ["--backend-config=python,shm-default-byte-size=268435456",
                                 "--backend-config=python,shm-growth-byte-size=67108864"]
    assert portable.server_args() == []
    assert gpu.needs_gpu and gpu.share_server and gpu.mps and not portable.share_server
    # requests in flight per engine keep the actor's call busy: a call's images fill the requests at least once
    assert REGISTRY["triton"].gpu_batch_size >= gpu.request_batch * gpu.concurrency
    with pytest.raises(ConfigError, match=r"profile='cpu' is unknown; use auto, portable, gpu"):
        profiles.choose_profile("cpu")


@pytest.mark.parametrize("gpus, cpus", [(1, 16), (2, 32), (8, 128)])
def test_the_gpu_shape_scales_with_the_gpus_of_a_node(gpus, cpus):
    """auto on a node of ``gpus`` H200-like GPUs: three actors per GPU at a third of one each, a core each, cores
    left for the fetch, write and listing tasks, and the fetch-ahead budget growing with the actors."""
    from pipeline.job.stages import actor_plan, fetch_budget

    resolved = resolve(config(), gpus, "the Ray cluster at x")[0]
    actors, actor_cpus, gpus_each = actor_plan(resolved, cpus, gpus)
    assert (actors, actor_cpus) == (3 * gpus, 1.0) and gpus_each == pytest.approx(1 / 3)
    assert cpus - actors * actor_cpus >= 13 * gpus  # the other tasks' share of a 16-core GPU's node
    budget = fetch_budget(actors, resolved.batch_size, on_gpu=True)
    assert budget == actors * fetch_budget(1, resolved.batch_size, on_gpu=True)
