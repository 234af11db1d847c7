"""pipeline/gpu/cuda_sync.py: how the gpu classifier's threads wait for the GPU, and its repository option."""

from __future__ import annotations

import ctypes

import pytest

from pipeline.gpu.cuda_sync import SYNC_FLAGS, check_cuda_sync, set_cuda_sync
from pipeline.errors import EngineError
from pipeline.triton import contract as tn


def _has_libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_a_wrong_mode_fails_at_once_naming_the_choices():
    with pytest.raises(EngineError, match=r"cuda_sync must be one of auto, spin, yield, block, got 'sleep'"):
        check_cuda_sync("sleep")
    with pytest.raises(EngineError, match="cuda_sync must be one of"):
        set_cuda_sync(0, "sleep")
    assert check_cuda_sync("block") == "block"


def test_the_flags_are_the_drivers_scheduling_values():
    # CU_CTX_SCHED_AUTO / SPIN / YIELD / BLOCKING_SYNC in cuda.h
    assert SYNC_FLAGS == {"auto": 0, "spin": 1, "yield": 2, "block": 4}


@pytest.mark.skipif(_has_libcuda(), reason="a CUDA driver is installed: the GPU tests cover this machine")
def test_without_a_cuda_driver_nothing_is_set_and_it_says_so():
    assert set_cuda_sync(0, "block") == "unknown"


def test_the_gpu_profile_carries_the_option_to_its_model():
    pytest.importorskip("tritonclient.grpc")
    from pipeline.triton.configs import GpuModelOptions, gpu_config

    text = gpu_config(GpuModelOptions(cuda_sync="block"))
    assert f'key: "{tn.GPU_PARAM_CUDA_SYNC}"' in text and 'string_value: "block"' in text
    assert tn.GPU_PARAM_CUDA_SYNC not in gpu_config()  # unset: the model's default


def test_the_gpu_engine_option_refuses_a_wrong_mode_before_the_run():
    from pipeline.config import RunConfig
    from pipeline.errors import ConfigError
    from pipeline.job.plan import preflight

    cluster = "ray://head:10001"  # the plan's parse of the options; a cluster's nodes would run the preflight
    with pytest.raises(ConfigError, match=r"cuda_sync='sleep' \(engine 'gpu'\) is not one of auto, spin, yield, block"):
        preflight(RunConfig(source="in/", output="out/", engine="gpu", engine_options={"cuda_sync": "sleep"}), cluster)
    ok = RunConfig(source="in/", output="out/", engine="gpu", engine_options={"cuda_sync": "block"})
    assert preflight(ok, cluster)[1] == {"cuda_sync": "block"}
