"""Embeddings on a real GPU: a user's model declaring one (converted to torch, FP16 where the precision gate keeps
it, CUDA graphs) gives ONNX Runtime's embeddings on real photos, alone and beside the built-in model in a set; a set
whose models the gate splits into FP16 and FP32 answers as each alone. The CPU counterpart:
tests/integration/test_gpu_embedding.py."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.model.folder import load_model
from pipeline.schema import STATUS_OK
from support import user_models
from support.oddities import photo_set

torch = pytest.importorskip("torch")
pytest.importorskip("onnx2torch")

# FP16 on the GPU and nvJPEG against ONNX Runtime's FP32 on Pillow's decode: each embedding's cosine at least this.
COSINE_BOUND = 0.999


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    return load_model(user_models.model_folder(tmp_path_factory.mktemp("user") / "embed",
                                               user_models.TinyNet(scale=20.0), embedding=True))


def test_the_gpu_gives_onnx_runtimes_embeddings_alone_and_in_a_set(embedder):
    from pipeline.engines.gpu import GpuEngine

    images = photo_set()
    logits, want = user_models.onnx_embeddings(embedder, images)
    with GpuEngine(embedder, top_k=3) as engine:
        assert engine.classifier.is_cuda
        alone = engine.classify(images)
    with GpuEngine(load_model(None), top_k=3, more=(embedder,)) as engine:
        in_set = [r.more[0] for r in engine.classify(images)]
    for label, rows in (("alone", alone), ("in a set", in_set)):
        assert [r.status for r in rows] == [STATUS_OK] * len(images), label
        cosines = [user_models.cosine(r.embedding, w) for r, w in zip(rows, want)]
        print(f"{label}: cosine to ONNX Runtime's embeddings over {len(rows)} photos: 1 - min = {1 - min(cosines):.1e}")
        assert min(cosines) > COSINE_BOUND, label
        assert all(abs(np.linalg.norm(r.embedding) - 1) < 1e-4 for r in rows), label
        assert sum(r.class_ids[0] == int(np.argmax(x)) for r, x in zip(rows, logits)) >= len(rows) - 1, label


def test_a_set_the_precision_gate_splits_answers_as_each_model_alone(embedder, tmp_path):
    from pipeline.engines.gpu import GpuEngine

    huge = load_model(user_models.model_folder(tmp_path / "huge", user_models.TinyNet(scale=1e6)))  # overflows FP16
    images = photo_set()
    with GpuEngine(embedder, top_k=3, more=(huge,)) as engine:
        classifier = engine.classifier
        assert classifier.half and not classifier._models[1].half and not classifier.dali_half
        both = engine.classify(images)
    with GpuEngine(embedder, top_k=3) as engine:
        first_alone = engine.classify(images)
    with GpuEngine(huge, top_k=3) as engine:
        assert not engine.classifier.half
        second_alone = engine.classify(images)
    for i, row in enumerate(both):
        (second,) = row.more
        assert row.status == second.status == STATUS_OK, i
        assert row.class_ids == first_alone[i].class_ids and second.class_ids == second_alone[i].class_ids, i
        assert row.scores == pytest.approx(first_alone[i].scores, abs=2e-3), i
        assert second.scores == pytest.approx(second_alone[i].scores, abs=1e-4), i
        assert user_models.cosine(row.embedding, first_alone[i].embedding) > 1 - 1e-4, i
