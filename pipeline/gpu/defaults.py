"""What the GPU paths run with unless told otherwise, what they need and what they cannot run: stdlib only, so the
configs, engine specs and preflights that name them load no torch or DALI.

The gpu engine in the actor's process and the gpu profile's served model (``pipeline.triton``) read these same values.
"""

from __future__ import annotations

from pipeline.node import importable

GPU_DEFAULT_BATCH_SIZE = 256  # network batch inside one call; GpuClassifier's default
GPU_DEFAULT_PREP_WORKERS = 2  # threads preparing batches ahead of the network; GpuClassifier's default
GPU_DEFAULT_MAX_DELAY_MS = 2.0  # queued images wait this long for a full network batch while the GPU idles
DALI_THREADS = 4  # CPU threads of one DALI pipeline: the gpu paths' default and the production profile's
# How the gpu paths' threads wait for the GPU (pipeline.gpu.cuda_sync): CUDA's default, spin, yield or sleep.
CUDA_SYNC_MODES = ("auto", "spin", "yield", "block")
# The GPU paths run torch networks in FP32/FP16 and would need TensorRT for INT8 (ONNX Runtime's integer kernels run
# INT8 models: the onnx engine, the triton engine's portable profile).
NO_INT8 = "no INT8 on the GPU paths without TensorRT"
GPU_STACK = ("torch", "nvidia.dali")  # what the GPU paths import: in the actor, or in the gpu profile's server
GPU_EXTRA_HINT = "pip install 'bulk-classify[gpu]' and PyTorch with CUDA"


def missing_gpu_stack() -> list[str]:
    """The GPU paths' imports that this machine lacks."""
    return [m for m in GPU_STACK if not importable(m)]
