"""A model set through the triton engine's gpu profile on a real GPU: the built-in model and a user's folder declaring an
embedding, served as one model (DALI "mixed" decode once, each network converted and FP16-gated, CUDA graphs, MPS),
answer each as that model through the onnx engine on the CPU. The CPU counterpart:
tests/integration/test_gpu_profile_model_set.py."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.model.folder import load_model
from pipeline.schema import STATUS_ERROR, STATUS_OK
from support import user_models
from support.oddities import photo_set
from support.paths import PARITY

torch = pytest.importorskip("torch")
pytest.importorskip("onnx2torch")
pytest.importorskip("tritonclient")

TOP_K = 5
# FP16 on the GPU and nvJPEG against ONNX Runtime's FP32 on Pillow's decode: the top-1 probability within this ...
SCORE_BOUND = 0.05
# ... and each embedding's cosine at least this (test_embedding_on_gpu.py's).
COSINE_BOUND = 0.999
DECIDED = 0.02  # a top-1 margin over the second class past which the top-1 must agree


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = user_models.model_folder(tmp_path_factory.mktemp("user") / "embed", user_models.TinyNet(scale=20.0),
                                      embedding=True)
    return load_model(None), load_model(folder)


def test_the_gpu_profile_serves_a_set_on_the_card_as_the_onnx_engine_answers_each_model(models):
    from pipeline.engines.onnx import OnnxEngine
    from pipeline.engines.registry import engine_spec
    from pipeline.model.imaging import DecodeLimits

    builtin, user = models
    images = photo_set() + [p.read_bytes() for p in sorted((PARITY / "inputs").glob("*.jpg"))[:40]]
    images.append(b"not an image at all")
    spec = engine_spec("triton")
    engine = spec.build(builtin, top_k=TOP_K, limits=DecodeLimits(), more=(user,),
                        options=spec.parse_options({"profile": "gpu"}))
    try:
        assert engine.profile.name == "gpu"
        got = engine.classify(images)
    finally:
        engine.close()
    with OnnxEngine(builtin, top_k=TOP_K) as onnx:
        first_ort = onnx.classify(images)
    with OnnxEngine(user, top_k=TOP_K) as onnx:
        second_ort = onnx.classify(images)
    assert [r.status for r in got] == [STATUS_OK] * (len(images) - 1) + [STATUS_ERROR]
    assert got[-1].more == []
    for label, want, pick in (("built-in", first_ort, lambda r: r), ("user", second_ort, lambda r: r.more[0])):
        rows = [pick(r) for r in got[:-1]]
        assert all(r.status == STATUS_OK for r in rows), label
        decided = [i for i, r in enumerate(want[:-1]) if r.scores[0] - r.scores[1] > DECIDED]
        agree = sum(rows[i].class_ids[0] == want[i].class_ids[0] for i in decided)
        worst = max(abs(a.scores[0] - b.scores[0]) for a, b in zip(rows, want))
        print(f"{label}: top-1 equal on {agree} of {len(decided)} decided photos, top-1 probability "
              f"within {worst:.1e}")
        assert agree >= len(decided) - 1 and worst < SCORE_BOUND, label
    cosines = [user_models.cosine(r.more[0].embedding, w.embedding) for r, w in zip(got[:-1], second_ort)]
    print(f"user embedding: cosine to ONNX Runtime's over {len(cosines)} photos: 1 - min = {1 - min(cosines):.1e}")
    assert min(cosines) > COSINE_BOUND
    assert all(r.embedding is None for r in got[:-1])
    assert all(np.linalg.norm(r.more[0].embedding) == pytest.approx(1.0, abs=1e-3) for r in got[:-1])
