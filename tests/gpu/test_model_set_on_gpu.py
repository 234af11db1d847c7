"""A model set on a real GPU: the gpu engine with the built-in model and a user's folder (converted to torch, FP16,
CUDA graphs) in one pass answers as each model alone and as ONNX Runtime, and DALI's "mixed" branches follow each
model's spec like the reference. The CPU counterparts: tests/integration/test_gpu_model_set.py and
test_dali_model_set.py."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.model.folder import load_model
from pipeline.schema import STATUS_OK
from support.oddities import photo_set

torch = pytest.importorskip("torch")
pytest.importorskip("onnx2torch")

# FP16 on the GPU against ONNX Runtime's FP32 on the CPU: the top-1 probability within this.
SCORE_BOUND = 0.05


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from support.user_models import TinyNet, model_folder

    folder = model_folder(tmp_path_factory.mktemp("user") / "tiny", TinyNet(scale=20.0))
    return load_model(None), load_model(folder)


def test_two_models_on_the_gpu_answer_as_each_alone_and_as_onnx_runtime(models):
    from pipeline.engines.gpu import GpuEngine
    from pipeline.engines.onnx import OnnxEngine

    builtin, user = models
    images = photo_set()
    with GpuEngine(builtin, top_k=5, more=(user,)) as engine:
        assert engine.classifier.is_cuda and engine.classifier.dali_half
        both = engine.classify(images)
    with GpuEngine(builtin, top_k=5) as engine:
        first_alone = engine.classify(images)
    with GpuEngine(user, top_k=5) as engine:
        second_alone = engine.classify(images)
    with OnnxEngine(builtin, top_k=5) as engine:
        first_ort = engine.classify(images)
    with OnnxEngine(user, top_k=5) as engine:
        second_ort = engine.classify(images)
    for label, alone, ort, pick in (("built-in", first_alone, first_ort, lambda r: r),
                                    ("user", second_alone, second_ort, lambda r: r.more[0])):
        got = [pick(r) for r in both]
        assert [r.status for r in got] == [STATUS_OK] * len(images), label
        assert [r.class_ids for r in got] == [r.class_ids for r in alone], label
        assert max(abs(a.scores[0] - b.scores[0]) for a, b in zip(got, alone)) < 1e-3, label
        decided = [i for i, r in enumerate(ort) if r.scores[0] - r.scores[1] > 0.02]
        assert sum(got[i].class_ids[0] == ort[i].class_ids[0] for i in decided) >= len(decided) - 1, label
        assert max(abs(a.scores[0] - b.scores[0]) for a, b in zip(got, ort)) < SCORE_BOUND, label


def test_dali_branches_on_the_gpu_follow_each_models_spec_like_the_reference():
    from pipeline.gpu.classifier import Chunk, ClassifierOptions, GpuClassifier, SetModel, triage
    from pipeline.model.default_model import DEFAULT_SPEC
    from pipeline.model.imaging import PreprocessSpec, load_and_preprocess

    other = PreprocessSpec(resize_shorter=256, interpolation="bilinear", crop=(224, 224), scale=1 / 255,
                           mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), channel_order="BGR")
    options = ClassifierOptions(cuda_graph=False, half=False, pipeline=False)
    datas = photo_set()

    def prepared(spec, more=()):
        clf = GpuClassifier(torch.nn.Identity(), spec, options, more=more)
        chunk = Chunk([triage(i, d, clf.limits) for i, d in enumerate(datas)])
        clf._prepare(chunk)
        clf.close()
        assert chunk.ok == list(range(len(datas))) and not chunk.errors
        return chunk

    chunk = prepared(DEFAULT_SPEC, (SetModel(torch.nn.Identity(), other),))
    assert len(chunk.branch_inputs) == 2
    # Each spec's mean bound against the reference is the one its model alone meets: the built-in spec's
    # (test_gpu_engine_on_gpu.py), and any user spec's (test_user_model_on_gpu.py: bilinear resizes differ more).
    for spec, inputs, mean_bound in zip((DEFAULT_SPEC, other), chunk.branch_inputs, (0.1, 0.2)):
        alone = prepared(spec).inputs
        for row, pos in enumerate(chunk.ok):
            got = inputs[row].float().cpu().numpy()
            assert np.abs(got - alone[row].float().cpu().numpy()).max() < 1e-5, (spec, pos)  # as the model alone
            ref, _, _ = load_and_preprocess(chunk.items[pos].data, spec)
            levels = np.abs(got - ref) * np.array(spec.std)[:, None, None] / spec.scale
            # nvJPEG's IDCT rounds a few edge pixels differently from libjpeg (test_gpu_engine_on_gpu.py's bound)
            assert levels.max() <= 8.0 and levels.mean() < mean_bound, (spec, pos, levels.max(), levels.mean())
