"""A model set through --engine triton (portable profile, a real tritonserver on the CPU): the built-in model and two
small user folders served as one model, each image decoded once; every model's answers equal --engine onnx's for
that model alone, on real photos and odd inputs; each model's own status; the repository cached by the set."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.odd_models import INPUT, SPEC, bright_images, model_folder
from support.oddities import oddities
from support.paths import PARITY, PHOTOS

from pipeline.engines.base import NONFINITE_ERROR
from pipeline.engines.registry import engine_spec, make_engine
from pipeline.errors import ConfigError, TritonError
from pipeline.model.folder import load_model
from pipeline.model.imaging import DecodeLimits
from pipeline.triton import contract as tn
from pipeline.triton.profiles import PROFILES
from pipeline.triton.repository import build_repository
from pipeline.triton.repository_cache import cached_repository

TOP_K = 5
# The same ONNX graphs and the same reference preprocessing on both sides; only batch composition differs.
SCORE_TOLERANCE = 1e-4
PARITY_PHOTOS = 40  # of tests/data/parity/inputs, beside tests/data/photos


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """The set: the built-in model, a 5-class user folder, one whose output turns NaN/infinite on bright images, and
    one that declares an embedding (its pooled colour, an intermediate tensor)."""
    root = tmp_path_factory.mktemp("set")
    return [load_model(None), load_model(str(model_folder(root / "products", "logits", seed=3))),
            load_model(str(model_folder(root / "bright", "nonfinite", seed=4, classes=7))),
            load_model(str(model_folder(root / "embedded", "logits", seed=5, spec=embedding_spec(True))))]


def embedding_spec(normalize: bool) -> dict:
    return {**SPEC, "embedding": {"output": EMBEDDING_TENSOR, "dim": 3, "normalize": normalize}}


EMBEDDING_TENSOR = "flat"  # odd_models' mean colour per image, [batch, 3]


def reference_embeddings(bundle, blobs: list[bytes]):
    """ONNX Runtime on the original graph with the embedding tensor as an output, on the reference preprocessing,
    each row L2-normalised in float64 where the spec says; None for an input that does not decode."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from pipeline.errors import ImageError
    from pipeline.model.imaging import load_and_preprocess

    model = onnx.load(str(bundle.onnx_path))
    model.graph.output.append(onnx.helper.make_empty_tensor_value_info(EMBEDDING_TENSOR))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = []
    for blob in blobs:
        try:
            array = load_and_preprocess(blob, bundle.spec)[0]
        except ImageError:
            out.append(None)
            continue
        vector = session.run([EMBEDDING_TENSOR], {INPUT: array[None]})[0][0].astype(np.float64)
        if bundle.spec.embedding.normalize and np.linalg.norm(vector) > 0:
            vector = vector / np.linalg.norm(vector)
        out.append(vector)
    return out


@pytest.fixture(scope="module")
def set_engine(bundles):
    spec = engine_spec("triton")
    engine = spec.build(bundles[0], top_k=TOP_K, limits=DecodeLimits(), more=bundles[1:],
                        options=spec.parse_options({"profile": "portable", "request_batch": 8, "concurrency": 2}))
    yield engine
    engine.close()


def _inputs() -> dict[str, bytes]:
    inputs = {p.stem: p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))}
    inputs.update({f"parity_{p.stem}": p.read_bytes() for p in sorted(PARITY.glob("inputs/*.jpg"))[:PARITY_PHOTOS]})
    inputs.update({f"odd_{name}": data for name, (data, _, _) in oddities().items()})
    inputs.update(bright_images())
    return inputs


def _same(got, want, where: str) -> None:
    assert (got.status, got.error) == (want.status, want.error), where
    if got.status == "ok":
        assert got.class_ids == want.class_ids, where
        assert got.labels == want.labels, where
        assert max(abs(a - b) for a, b in zip(got.scores, want.scores)) < SCORE_TOLERANCE, where


def test_every_model_of_the_set_answers_as_the_onnx_engine_does_alone(bundles, set_engine):
    inputs = _inputs()
    names, blobs = list(inputs), list(inputs.values())
    got = set_engine.classify(blobs)
    assert len(got) == len(blobs)
    wants = []
    for bundle in bundles:
        onnx = make_engine("onnx", bundle, top_k=TOP_K, limits=DecodeLimits())
        try:
            wants.append(onnx.classify(blobs))
        finally:
            onnx.close()
    decoded = 0
    for i, (name, row) in enumerate(zip(names, got)):
        first = wants[0][i]
        assert (row.width, row.height) == (first.width, first.height), name
        if first.error and first.error.split(":", 1)[0] != "engine_error":  # not decoded: every model's error
            _same(row, first, name)
            assert row.more == [], name
            continue
        decoded += 1
        _same(row, first, name)
        assert len(row.more) == len(bundles) - 1, name
        for index, (theirs, want) in enumerate(zip(row.more, [w[i] for w in wants[1:]]), start=1):
            _same(theirs, want, f"{name}, model {index}")
    assert decoded >= len(list(PHOTOS.glob("*.jpg"))) + PARITY_PHOTOS
    # each model its own status: the bright images are the third model's errors only
    for name in bright_images():
        row = got[names.index(name)]
        assert row.status == "ok" and row.more[0].status == "ok", name
        assert (row.more[1].status, row.more[1].error) == ("error", NONFINITE_ERROR), name
    assert all(len(r.more[0].class_ids) == TOP_K for r in got if r.status == "ok")
    # the fourth model's embedding, and none for the others
    reference = reference_embeddings(bundles[3], blobs)
    for name, row, want in zip(names, got, reference):
        if row.status != "ok":
            continue
        assert row.embedding is None and [m.embedding is None for m in row.more] == [True, True, False], name
        assert max(abs(a - b) for a, b in zip(row.more[2].embedding, want)) < 1e-6, name
        assert abs(sum(v * v for v in row.more[2].embedding) - 1) < 1e-5, name


def test_one_model_with_an_embedding_answers_it_unnormalised_where_its_spec_says(tmp_path):
    bundle = load_model(str(model_folder(tmp_path / "raw", "logits", seed=6, spec=embedding_spec(False))))
    blobs = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))] + [b"not an image"]
    engine = make_engine("triton", bundle, top_k=3, profile="portable", request_batch=4)
    try:
        got = engine.classify(blobs)
    finally:
        engine.close()
    for row, want in zip(got, reference_embeddings(bundle, blobs)):
        if want is None:
            assert row.status == "error" and row.embedding is None
            continue
        assert row.status == "ok" and row.more == []
        assert len(row.embedding) == 3 and max(abs(a - b) for a, b in zip(row.embedding, want)) < 1e-6
    assert any(abs(sum(v * v for v in row.embedding) - 1) > 1e-3 for row in got[:-1])  # not normalised


def test_each_model_answers_top_k_up_to_its_own_classes(bundles):
    spec = engine_spec("triton")
    engine = spec.build(bundles[1], top_k=7, limits=DecodeLimits(), more=[bundles[0]],
                        options=spec.parse_options({"profile": "portable"}))
    try:
        rows = engine.classify([p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))[:3]])
    finally:
        engine.close()
    assert [(len(r.class_ids), len(r.more[0].class_ids)) for r in rows] == [(5, 7)] * 3


def test_a_server_without_the_sets_outputs_is_refused(bundles, set_engine):
    make_engine("triton", bundles[0], top_k=TOP_K, url=set_engine.url).close()  # its first model alone: served
    spec = engine_spec("triton")
    with pytest.raises(TritonError, match=r"lacks CLASS_IDS_4, SCORES_4 .* for this set of 5 models"):
        spec.build(bundles[0], top_k=TOP_K, limits=DecodeLimits(), more=[*bundles[1:], bundles[1]],
                   options=spec.parse_options({"url": set_engine.url}))


def test_the_repository_is_cached_by_the_set(bundles, tmp_path):
    portable = PROFILES["portable"]
    one = cached_repository(portable, bundles[1], top_k=3, cache_dir=tmp_path)
    pair = cached_repository(portable, bundles[1], top_k=3, more=[bundles[2]], cache_dir=tmp_path)
    assert cached_repository(portable, bundles[1], top_k=3, more=[bundles[2]], cache_dir=tmp_path) == pair
    swapped = cached_repository(portable, bundles[2], top_k=3, more=[bundles[1]], cache_dir=tmp_path)
    assert len({one, pair, swapped}) == 3
    version = pair / tn.MODEL_NAME / tn.VERSION
    assert (version / tn.SET_FOLDER.format(index=1) / "model.onnx").is_file()
    assert not (one / tn.MODEL_NAME / tn.VERSION / tn.SET_FOLDER.format(index=1)).exists()
    config = (pair / tn.MODEL_NAME / "config.pbtxt").read_text()
    assert 'name: "SCORES_1"' in config and 'name: "CLASS_IDS_1"' in config


def test_the_production_profile_refuses_a_set_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="^the production profile serves one model, not a model set; use "
                                          "--engine-option profile=portable or gpu for a set, or one --model$"):
        build_repository("production", None, str(tmp_path / "production"), more=[None])


def test_the_served_set_decodes_each_image_once(bundles, tmp_path, monkeypatch):
    import numpy as np

    from pipeline.model import imaging
    from pipeline.triton.serve.portable_model import Classifier

    repo = build_repository("portable", None, str(tmp_path), top_k=TOP_K, more=[str(Path(b.onnx_path).parent)
                                                                                 for b in bundles[1:]])
    classifier = Classifier(repo / tn.MODEL_NAME / tn.VERSION, intra_op_threads=1, decode_threads=1)
    assert [net.k for net in classifier.networks] == [TOP_K] * 4
    assert [net.embedding_dim for net in classifier.networks] == [None, None, None, 3]
    decodes = []
    real = imaging.decode_image
    monkeypatch.setattr(imaging, "decode_image", lambda data, limits: decodes.append(1) or real(data, limits))
    photos = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))[:4]]
    longest = max(map(len, photos))
    images = np.stack([np.frombuffer(p.ljust(longest, b"\0"), np.uint8) for p in photos])
    out = classifier.classify(images, np.array([[len(p)] for p in photos], np.int32))
    assert len(decodes) == len(photos)
    assert {tn.set_output(name, i) for i in range(4) for name in tn.SET_OUTPUTS} <= set(out)
    assert out[tn.set_output(tn.OUTPUT_EMBEDDING, 3)].shape == (len(photos), 3)
