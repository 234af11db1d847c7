"""One model folder through every engine this machine runs, on the CPU: onnx, openvino, the triton engine's portable
profile in a real tritonserver, the gpu engine (DALI's CPU backend, torch on the CPU) and the gpu profile's python
model in a real tritonserver (KIND_CPU). Each gives its rows for the same images."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pipeline.engines.registry import make_engine
from pipeline.model.folder import load_model
from pipeline.triton import contract as tn

CPU_ENGINES = ("onnx", "openvino", "triton-portable", "gpu-cpu", "triton-gpu-cpu")


def available() -> tuple[str, ...]:
    """The CPU_ENGINES this machine has what they need for."""
    have = {m: importlib.util.find_spec(m) is not None for m in ("openvino", "torch", "onnx2torch", "tritonclient")}
    dali = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
    gpu = have["torch"] and have["onnx2torch"] and dali
    wanted = {"onnx": True, "openvino": have["openvino"], "triton-portable": have["tritonclient"],
              "gpu-cpu": gpu, "triton-gpu-cpu": gpu and have["tritonclient"]}
    return tuple(name for name in CPU_ENGINES if wanted[name])


def classify_everywhere(folder: Path, images: list[bytes], tmp_path: Path, *, top_k: int,
                        engines: tuple[str, ...] | None = None) -> dict[str, list]:
    """{engine: its Results for ``images``} for ``folder``'s model on each of ``engines`` (default: ``available()``)."""
    bundle = load_model(folder)
    rows = {}
    for name in engines or available():
        if name in ("onnx", "openvino"):
            with make_engine(name, bundle, top_k=top_k) as engine:
                rows[name] = engine.classify(images)
        elif name == "triton-portable":
            engine = make_engine("triton", bundle, top_k=top_k, profile="portable", request_batch=4, concurrency=1)
            try:
                rows[name] = engine.classify(images)
            finally:
                engine.close()
        elif name == "gpu-cpu":
            from pipeline.engines.gpu import GpuEngine

            with GpuEngine(bundle, top_k=top_k, device="cpu", batch_size=4) as engine:
                rows[name] = engine.classify(images)
        else:
            rows[name] = served_gpu_profile(folder, bundle, images, tmp_path / "gpu-repo", top_k=top_k)
    return rows


def served_gpu_profile(folder: Path, bundle, images: list[bytes], repo_dir: Path, *, top_k: int) -> list:
    """The gpu profile's answers for ``folder`` in a real tritonserver on the CPU (its instance KIND_CPU)."""
    from pipeline.engines.triton import TritonEngine
    from pipeline.triton.repository import build_gpu_repository
    from pipeline.triton.server import TritonServer

    repo = build_gpu_repository(str(folder), repo_dir, instances=1, batch_size=4, max_batch_size=16, top_k=top_k)
    config = repo / tn.MODEL_NAME / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_GPU", "KIND_CPU"))
    with TritonServer(repo) as server:
        engine = TritonEngine(bundle, url=server.grpc_url, top_k=top_k, request_batch=4, concurrency=1)
        try:
            return engine.classify(images)
        finally:
            engine.close()
