"""Embeddings and the model set's corners on the GPU paths, on the CPU (DALI's CPU backend, torch on the CPU): a user's
model declaring an embedding gives the onnx engine's embeddings through the gpu engine on real photos; the conversion
check holds the embedding to ONNX Runtime's and the network cache keys on its declaration; a set of an FP16 and an
FP32 model answers as each alone; a non-finite output of one model of a set is that model's error only. The GPU
tier's counterpart: tests/gpu/test_embedding_on_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.engines.base import NONFINITE_ERROR
from pipeline.errors import ModelError
from pipeline.model.folder import MODEL_FILE, load_model
from pipeline.schema import STATUS_ERROR, STATUS_OK
from support import odd_models, user_models
from support.oddities import photo_set
from support.paths import PARITY

torch = pytest.importorskip("torch")
pytest.importorskip("nvidia.dali", reason="the gpu engine needs nvidia-dali-cuda130 (the test extra)")
pytest.importorskip("onnx2torch")
pytest.importorskip("onnxslim")

# DALI's resize is not Pillow's to the last bit: each embedding's cosine to the onnx engine's is at least this.
COSINE_BOUND = 0.999
# ... and the top-1 probability within this (test_gpu_user_model.py's bound).
SCORE_BOUND = 0.05


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A user's model whose spec declares its flattened features (an intermediate tensor) as its embedding."""
    return load_model(user_models.model_folder(tmp_path_factory.mktemp("user") / "embed",
                                               user_models.TinyNet(scale=20.0), embedding=True))


@pytest.fixture(scope="module")
def photos():
    """The committed photos (with an EXIF-rotated JPEG and a PNG) and the parity inputs: real photos of both kinds
    DALI and the reference decode."""
    return photo_set() + [p.read_bytes() for p in sorted((PARITY / "inputs").glob("*.jpg"))[:8]]


def _onnx(bundle, images, top_k, more=()):
    from pipeline.engines.onnx import OnnxEngine

    with OnnxEngine(bundle, top_k=top_k, more=more) as engine:
        return engine.classify(images)


@pytest.mark.parametrize("pipeline", [True, False], ids=["stream", "classify"])
def test_the_gpu_engine_gives_onnx_runtimes_embeddings_on_real_photos(embedder, photos, pipeline):
    from pipeline.engines.gpu import GpuEngine

    with GpuEngine(embedder, top_k=3, device="cpu", batch_size=4, pipeline=pipeline) as engine:
        got = engine.classify(photos + [b"not an image"])
    logits, want = user_models.onnx_embeddings(embedder, photos)
    cosines = []
    for i, row in enumerate(got[:-1]):
        assert row.status == STATUS_OK, (i, row.error)
        assert len(row.embedding) == user_models.EMBEDDING_DIM
        assert np.linalg.norm(row.embedding) == pytest.approx(1.0, abs=1e-5)  # normalize: true
        cosines.append(user_models.cosine(row.embedding, want[i]))
        assert row.class_ids[0] == int(np.argmax(logits[i])), i
    print(f"cosine to ONNX Runtime's embeddings over {len(cosines)} photos: 1 - min = {1 - min(cosines):.1e}")
    assert min(cosines) > COSINE_BOUND
    assert got[-1].status == STATUS_ERROR and got[-1].embedding is None


def test_the_conversion_holds_the_embedding_to_onnx_runtime_and_refuses_a_wrong_declaration(embedder, tmp_path):
    from pipeline.gpu import onnx_torch
    from pipeline.model.spec import PreprocessSpec

    conversion = onnx_torch.convert_checked(embedder.onnx_path, embedder.spec)
    logits, features = onnx_torch.run_outputs(conversion.network, conversion.reference.inputs)
    assert conversion.reference.embeddings.shape == (len(logits), user_models.EMBEDDING_DIM)
    assert onnx_torch.embedding_agreement(features, conversion.reference.embeddings).rel_l2 < 1e-5
    assert onnx_torch.embedding_agreement(features[:, ::-1], conversion.reference.embeddings).rel_l2 > 0.1

    # The same features as the graph's second output: the converted network returns them the same way.
    both = user_models.model_folder(tmp_path / "two", user_models.EmbedNet(scale=20.0))
    again = onnx_torch.convert_checked(both / MODEL_FILE, PreprocessSpec(**user_models.embedding_spec()))
    assert np.allclose(again.reference.embeddings, conversion.reference.embeddings, atol=1e-5)
    assert np.allclose(again.reference.outputs, conversion.reference.outputs, atol=1e-5)

    output = embedder.spec.embedding.output
    wide = PreprocessSpec(**{**user_models.SPEC, "embedding": {"output": output, "dim": 64}})
    with pytest.raises(ModelError, match=rf"{output!r} is 128 wide and its spec says dim 64; set embedding.dim to 128"):
        onnx_torch.convert_checked(embedder.onnx_path, wide)
    missing = PreprocessSpec(**{**user_models.SPEC, "embedding": {"output": "nowhere", "dim": 8}})
    with pytest.raises(ModelError, match=r"embedding 'nowhere' cannot be read from its graph .*set embedding.output"):
        onnx_torch.convert_checked(embedder.onnx_path, missing)


def test_the_network_cache_keys_on_the_embedding_declaration_and_keeps_its_reference(embedder, tmp_path):
    from pipeline.gpu import network_cache
    from pipeline.model.spec import PreprocessSpec

    spec = embedder.spec
    plain = PreprocessSpec(**user_models.SPEC)
    raw = PreprocessSpec(**user_models.embedding_spec(spec.embedding.output, normalize=False))
    keys = {network_cache.entry_key(embedder.onnx_path, s, None)[0] for s in (spec, plain, raw)}
    assert len(keys) == 3
    assert "embedding" not in plain.to_dict()  # a spec without one keeps its canonical JSON (and old keys)

    first = network_cache.checked_network(embedder.onnx_path, spec, root=tmp_path)
    again = network_cache.checked_network(embedder.onnx_path, spec, root=tmp_path)
    assert not first.from_cache and again.from_cache
    assert np.array_equal(again.conversion.reference.embeddings, first.conversion.reference.embeddings)
    assert np.array_equal(onnx_torch_outputs(again)[1], onnx_torch_outputs(first)[1])


def onnx_torch_outputs(cached):
    from pipeline.gpu import onnx_torch

    return onnx_torch.run_outputs(cached.conversion.network, cached.conversion.reference.inputs)


def test_a_set_of_an_fp16_and_an_fp32_model_answers_as_each_alone(embedder, photos, tmp_path):
    """The FP32 model's DALI branch is FP32 and the FP16 model's input is cast from it; each model's answers are its
    own run alone (DALI's FP16 output there)."""
    from pipeline.engines.gpu import results_from_raw
    from pipeline.gpu.classifier import ClassifierOptions, GpuClassifier, SetModel
    from pipeline.gpu.networks import load_network

    tiny = load_model(user_models.model_folder(tmp_path / "tiny", user_models.TinyNet(scale=20.0)))
    fp16, fp32 = load_network(tiny), load_network(embedder)
    options = ClassifierOptions(top_k=3, device="cpu", batch_size=4, pipeline=False)
    fp16_options = ClassifierOptions(top_k=3, device="cpu", batch_size=4, pipeline=False, half=True)
    both = GpuClassifier(fp16, tiny.spec, fp16_options, more=(SetModel(fp32, embedder.spec, half=False),))
    try:
        assert both.half and both._models[1].half is False and not both.dali_half
        raw = both.classify(photos)
    finally:
        both.close()
    alone = {}
    for name, network, bundle, opts in (("fp16", fp16, tiny, fp16_options), ("fp32", fp32, embedder, options)):
        one = GpuClassifier(network, bundle.spec, opts)
        try:
            alone[name] = results_from_raw(one.classify(photos), bundle.labels)
        finally:
            one.close()
    rows = results_from_raw(raw, tiny.labels, [embedder.labels])
    for i, row in enumerate(rows):
        (second,) = row.more
        assert row.status == second.status == STATUS_OK, i
        assert row.class_ids == alone["fp16"][i].class_ids
        assert row.scores == pytest.approx(alone["fp16"][i].scores, abs=2e-3)  # FP16 of DALI's vs torch's cast
        assert second.class_ids == alone["fp32"][i].class_ids
        assert second.scores == pytest.approx(alone["fp32"][i].scores, abs=1e-5)
        assert user_models.cosine(second.embedding, alone["fp32"][i].embedding) > 1 - 1e-6
        assert row.embedding is None


@pytest.mark.parametrize("kinds", [("logits", "nonfinite"), ("nonfinite", "logits")], ids=["second", "first"])
def test_a_non_finite_output_of_one_model_of_a_set_is_that_models_error_only(kinds, photos, tmp_path):
    from pipeline.engines.gpu import GpuEngine

    first, second = (load_model(odd_models.model_folder(tmp_path / kind, kind, seed=n + 1))
                     for n, kind in enumerate(kinds))
    images = photos[:4] + list(odd_models.bright_images().values())
    with GpuEngine(first, top_k=3, more=(second,), device="cpu", batch_size=4) as engine:
        got = engine.classify(images)
    want = _onnx(first, images, 3, more=(second,))
    broken = kinds.index("nonfinite")
    for i, (row, ref) in enumerate(zip(got, want)):
        answers, refs = [row, *row.more], [ref, *ref.more]
        assert [(a.status, a.error) for a in answers] == [(r.status, r.error) for r in refs], i
        if i >= 4:  # a bright image: the broken model's error, the other model's answer
            assert answers[broken].error == NONFINITE_ERROR
            assert answers[1 - broken].status == STATUS_OK and answers[1 - broken].class_ids
        else:
            assert all(a.status == STATUS_OK for a in answers)


def test_a_non_finite_embedding_of_one_model_of_a_set_is_that_models_error_only(photos, tmp_path):
    from pipeline.engines.gpu import GpuEngine

    plain = load_model(odd_models.model_folder(tmp_path / "plain", "logits"))
    embeds = load_model(odd_models.model_folder(tmp_path / "embeds", "nonfinite_embedding", seed=2))
    images = photos[:4] + list(odd_models.bright_images().values())
    with GpuEngine(plain, top_k=3, more=(embeds,), device="cpu", batch_size=4) as engine:
        got = engine.classify(images)
    plain_ort = _onnx(plain, images, 3)
    _, want = user_models.onnx_embeddings(embeds, images)
    for i, row in enumerate(got):
        (second,) = row.more
        assert (row.status, row.class_ids) == (STATUS_OK, plain_ort[i].class_ids), i
        assert row.embedding is None
        if np.isfinite(want[i]).all():
            assert second.status == STATUS_OK and user_models.cosine(second.embedding, want[i]) > COSINE_BOUND, i
        else:  # the bright images: infinity and NaN in the embedding, finite logits
            assert i >= 4 and second.error == NONFINITE_ERROR and second.embedding is None
    assert sum(r.more[0].status == STATUS_ERROR for r in got) == 2
