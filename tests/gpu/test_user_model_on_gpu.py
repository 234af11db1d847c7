"""A user's ONNX model on a real GPU, on both GPU paths: the in-process gpu engine and the gpu profile through a real
tritonserver, each converting model.onnx to torch (FP16, CUDA graph) and answering like ONNX Runtime on the CPU."""

from __future__ import annotations

import pytest

from pipeline.model import MODEL_FILE, load_model
from pipeline.triton import contract as tn
from support.oddities import photo_set

torch = pytest.importorskip("torch")
pytest.importorskip("onnx2torch")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from support.user_models import TinyNet, model_folder

    return model_folder(tmp_path_factory.mktemp("user") / "tiny", TinyNet(scale=20.0))


def _decided(expected):
    return [i for i, r in enumerate(expected) if r.scores[0] - r.scores[1] > 0.02]


def test_a_users_model_on_both_gpu_paths_answers_like_onnx_runtime(folder, tmp_path):
    from pipeline.engines.gpu.engine import GpuEngine
    from pipeline.engines.onnx import OnnxEngine
    from pipeline.engines.triton import TritonEngine
    from pipeline.triton.repository import build_gpu_repository
    from pipeline.triton.server import TritonServer

    bundle = load_model(folder)
    images = photo_set()
    with OnnxEngine(bundle, top_k=5) as reference:
        expected = reference.classify(images)
    with GpuEngine(bundle, top_k=5) as local:
        assert local.classifier.is_cuda and local.classifier.half  # the precision gate passed: FP16
        in_process = local.classify(images)
    repo = build_gpu_repository(str(folder), tmp_path / "repo", instances=1, batch_size=64)
    assert (repo / tn.MODEL_NAME / "1" / MODEL_FILE).is_file()
    with TritonServer(repo) as server:
        engine = TritonEngine(bundle, url=server.grpc_url, top_k=5)
        served = engine.classify(images)
        engine.close()
    decided = _decided(expected)
    assert len(decided) >= len(images) // 2
    for rows in (in_process, served):
        assert [r.status for r in rows] == ["ok"] * len(images)
        agree = sum(rows[i].class_ids[0] == expected[i].class_ids[0] for i in decided)
        assert agree >= len(decided) - 1
