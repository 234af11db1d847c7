"""A model set on the gpu engine, on the CPU (DALI's CPU backend, torch on the CPU): the built-in model and a user's
folder in one pass give each model's answers as that model alone does, agreeing with ONNX Runtime, every input one row
(an undecodable one every model's error, no ``more``). The GPU tier's counterpart: tests/gpu/test_model_set_on_gpu.py."""

from __future__ import annotations

import pytest

from pipeline.model.folder import load_model
from pipeline.schema import STATUS_ERROR, STATUS_OK
from support.oddities import photo_set
from support.user_models import CLASSES, TinyNet, model_folder

torch = pytest.importorskip("torch")
pytest.importorskip("nvidia.dali", reason="the gpu engine needs nvidia-dali-cuda130 (the test extra)")
pytest.importorskip("onnx2torch")
pytest.importorskip("onnxslim")

TOP_K = 7  # more than the user's model's CLASSES: its top-k is capped at its classes
# DALI's resize is not Pillow's to the last bit: probabilities close, not equal (test_gpu_user_model.py's bound).
SCORE_BOUND = 0.05


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = model_folder(tmp_path_factory.mktemp("user") / "tiny", TinyNet(scale=20.0))
    return load_model(None), load_model(folder)


@pytest.fixture(scope="module")
def images():
    datas = photo_set()[:7]  # JPEGs (DALI) and the PNG (the reference)
    return datas + [b"not an image at all", datas[0][: len(datas[0]) // 3]]


def _onnx(bundle, images, top_k):
    from pipeline.engines.onnx import OnnxEngine

    with OnnxEngine(bundle, top_k=top_k) as engine:
        return engine.classify(images)


@pytest.mark.parametrize("pipeline", [True, False], ids=["stream", "classify"])
def test_two_models_in_one_pass_answer_as_each_alone_and_as_onnx_runtime(models, images, pipeline):
    from pipeline.engines.gpu import GpuEngine

    builtin, user = models
    options = dict(device="cpu", batch_size=4, pipeline=pipeline)
    with GpuEngine(builtin, top_k=TOP_K, more=(user,), **options) as engine:
        assert engine.classifier._prep.branches == [builtin.spec, user.spec]  # two specs: two branches
        both = engine.classify(images)
    with GpuEngine(builtin, top_k=TOP_K, **options) as engine:
        first_alone = engine.classify(images)
    with GpuEngine(user, top_k=CLASSES, **options) as engine:
        second_alone = engine.classify(images)
    first_ort, second_ort = _onnx(builtin, images, TOP_K), _onnx(user, images, CLASSES)
    assert len(both) == len(images)
    for i, row in enumerate(both):
        assert row.status == first_alone[i].status == first_ort[i].status, (i, row.error)
        if row.status == STATUS_ERROR:
            assert row.error == first_alone[i].error and row.more == []
            continue
        (second,) = row.more
        assert second.status == STATUS_OK and len(second.class_ids) == CLASSES
        assert row.class_ids == first_alone[i].class_ids and second.class_ids == second_alone[i].class_ids
        assert row.scores == pytest.approx(first_alone[i].scores, abs=1e-5)
        assert second.scores == pytest.approx(second_alone[i].scores, abs=1e-5)
        assert second.labels == [f"class{c}" for c in second.class_ids]
        for got, want in ((row, first_ort[i]), (second, second_ort[i])):
            if want.scores[0] - want.scores[1] > 0.02:  # decided: the same top-1
                assert got.class_ids[0] == want.class_ids[0], i
            assert abs(got.scores[0] - want.scores[0]) < SCORE_BOUND, i
    assert [r.status for r in both[-2:]] == [STATUS_ERROR, STATUS_ERROR]
