"""The CPU engines: ONNX Runtime's real photos land right, every odd input gives one result, top-k softmax; OpenVINO's
agree with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from support.oddities import EXPECTED_SIZES, exif_rotated_jpeg, photo_bytes as read_photo
from pipeline.engines.registry import make_engine
from pipeline.engines.onnx import OnnxEngine, topk_softmax
from pipeline.errors import ConfigError, ERROR_KINDS
from pipeline.engines.base import Result
from support.paths import PARITY



def _ids(result: Result) -> set[int]:
    assert result.status == "ok", result.error
    return set(result.class_ids)


def test_real_photos_land_right(onnx_engine, photo_bytes):
    names = ["chelsea", "coffee", "rocket"]
    chelsea, coffee, rocket = onnx_engine.classify([photo_bytes[n] for n in names])
    assert _ids(chelsea) & {281, 282, 283, 284, 285}, chelsea.labels  # tabby, tiger, Persian, Siamese, Egyptian cat
    assert _ids(coffee) & {967, 968, 504}, coffee.labels  # espresso, cup, coffee mug
    assert _ids(rocket) & {812, 657, 744}, rocket.labels  # space shuttle, missile, projectile
    assert chelsea.labels[0] in ("Egyptian cat", "tiger cat", "tabby")
    assert coffee.labels[0] == "espresso"
    assert (chelsea.width, chelsea.height) == (451, 300)


def test_results_are_top_k_softmax_probabilities(onnx_engine, photo_bytes):
    for result in onnx_engine.classify(list(photo_bytes.values())):
        assert result.status == "ok" and result.error is None
        assert len(result.class_ids) == len(result.labels) == len(result.scores) == 5
        assert all(a >= b for a, b in zip(result.scores, result.scores[1:]))
        assert 0 < sum(result.scores) <= 1.0 + 1e-6
        assert len(set(result.class_ids)) == 5


def test_every_odd_input_gives_exactly_one_result_in_order(onnx_engine, odd_images):
    names = list(odd_images)
    results = onnx_engine.classify([odd_images[n][0] for n in names])
    assert len(results) == len(names)
    for name, result in zip(names, results):
        _, status, kind = odd_images[name]
        assert result.status == status, (name, result.error)
        if status == "error":
            assert result.error.split(":")[0] == kind and kind in ERROR_KINDS, (name, result.error)
            assert result.class_ids == [] and result.scores == []
        else:
            assert result.error is None and len(result.class_ids) == 5, name
        if name in EXPECTED_SIZES:
            assert (result.width, result.height) == EXPECTED_SIZES[name], name


@pytest.mark.parametrize("name", ["chelsea", "rocket", "camera"])
def test_exif_rotated_photo_is_classified_upright(onnx_engine, name):
    from PIL import Image

    from support.oddities import encode, photo

    sideways = encode(photo(name).transpose(Image.Transpose.ROTATE_90), "JPEG", quality=90)  # no EXIF tag
    upright, rotated, ignored = onnx_engine.classify([read_photo(name), exif_rotated_jpeg(name), sideways])
    assert rotated.class_ids[0] == upright.class_ids[0]
    assert (rotated.width, rotated.height) == (upright.width, upright.height)
    assert abs(rotated.scores[0] - upright.scores[0]) < 0.05
    # The same pixels shown sideways classify differently: the check above would catch a missed rotation.
    assert ignored.class_ids[0] != upright.class_ids[0] or abs(ignored.scores[0] - upright.scores[0]) > 0.2


def test_photos_end_to_end_match_the_torch_original(onnx_engine, photo_bytes):
    fixture = np.load(PARITY / "torch_logits.npz")
    results = onnx_engine.classify([photo_bytes[Path(str(n)).stem] for n in fixture["photo_names"]])
    torch_ids, torch_probs = topk_softmax(fixture["photo_logits"], 5)
    for result, ids, probs in zip(results, torch_ids, torch_probs):
        assert result.class_ids[0] == ids[0]
        np.testing.assert_allclose(result.scores, probs, atol=0.02)  # Pillow versions resize a little differently


def test_batch_splitting_and_thread_count_do_not_change_results(default_bundle, photo_bytes, odd_images):
    images = list(photo_bytes.values()) + [odd_images["truncated_jpeg"][0], odd_images["webp"][0]]
    with OnnxEngine(default_bundle, top_k=3, decode_threads=1, max_batch=64) as one_batch:
        reference = one_batch.classify(images)
    with OnnxEngine(default_bundle, top_k=3, decode_threads=4, max_batch=3, intra_op_threads=1) as small_batches:
        split = small_batches.classify(images)
    assert [r.status for r in split] == [r.status for r in reference]
    for a, b in zip(split, reference):
        assert a.class_ids == b.class_ids and a.error == b.error
        np.testing.assert_allclose(a.scores, b.scores, atol=1e-5)


def test_a_runtime_failure_is_blamed_on_the_one_input(default_bundle, photo_bytes):
    engine = OnnxEngine(default_bundle, top_k=1)
    real_run = engine._run
    # Make ORT fail on any batch holding the all-white image (its input tensor is all 1.0).
    engine._run = lambda model, batch: (real_run(model, batch) if not (batch == 1.0).all(axis=(1, 2, 3)).any()
                                        else 1 / 0)
    from support.oddities import encode
    from PIL import Image

    white = encode(Image.new("RGB", (300, 300), "white"), "PNG")
    images = [photo_bytes["chelsea"], white, photo_bytes["coffee"], photo_bytes["rocket"]]
    results = engine.classify(images)
    engine.close()
    assert [r.status for r in results] == ["ok", "error", "ok", "ok"]
    assert results[1].error.startswith("engine_error: ") and (results[1].width, results[1].height) == (300, 300)
    assert results[2].labels[0] == "espresso"


def test_topk_softmax_of_no_rows():
    assert topk_softmax(np.zeros((0, 10)), 3)[0].shape == (0, 3)


def test_topk_softmax_matches_full_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 5, (4, 1000)).astype(np.float32)
    ids, probs = topk_softmax(logits, 5)
    full = np.exp(logits - logits.max(1, keepdims=True))
    full /= full.sum(1, keepdims=True)
    np.testing.assert_array_equal(ids, np.argsort(-full, axis=1)[:, :5])
    np.testing.assert_allclose(probs, np.take_along_axis(full, ids, 1), rtol=1e-5)
    ids_all, probs_all = topk_softmax(logits[:, :3], 10)  # k above the class count is capped
    assert ids_all.shape == (4, 3)
    np.testing.assert_allclose(probs_all.sum(1), 1.0, rtol=1e-6)
    assert topk_softmax(np.array([[1000.0, 0.0]]), 1)[1][0, 0] == pytest.approx(1.0)  # no overflow


def test_make_engine(default_bundle):
    with pytest.raises(ConfigError, match=r"--engine 'cuda' is unknown; choose one of auto, onnx, openvino, triton, gpu"):
        make_engine("cuda", default_bundle)
    with pytest.raises(ConfigError, match=r"engine 'onnx' has no option instances; its options are decode_threads, intra_op_threads, max_batch"):
        make_engine("onnx", default_bundle, instances=2)
    engine = make_engine("onnx", default_bundle, top_k=2, decode_threads=1)
    assert engine.name == "onnx" and engine.top_k == 2
    assert engine.classify([]) == []
    engine.close()


def test_engine_applies_its_decode_limits(default_bundle, photo_bytes):
    from pipeline.model.imaging import DecodeLimits

    with OnnxEngine(default_bundle, limits=DecodeLimits(max_bytes=40_000, max_pixels=200_000)) as engine:
        chelsea, coffee, astronaut = engine.classify([photo_bytes[n] for n in ("chelsea", "coffee", "astronaut")])
    assert chelsea.status == "ok"  # 35 KB, 451x300
    assert coffee.error.startswith("too_large: ") and "max_bytes=40000" in coffee.error  # 72 KB
    assert astronaut.error.startswith("too_large: ")  # 68 KB
    with OnnxEngine(default_bundle, limits=DecodeLimits(max_pixels=200_000)) as engine:
        (astronaut,) = engine.classify([photo_bytes["astronaut"]])
    assert astronaut.error == "too_many_pixels: 512x512 = 262144 pixels is over max_pixels=200000; raise the limit to accept it"


def test_openvino_classifies_like_onnx_in_one_call_and_in_concurrent_ones(default_bundle, photo_bytes, odd_images):
    """The openvino engine shares the onnx engine's decoding; its network gives the same top-k to float rounding,
    also when several calls share its streams at once (each thread has its own infer request)."""
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.engines.openvino import OpenVinoEngine

    images = list(photo_bytes.values()) + [data for data, _status, _kind in odd_images.values()]
    with OnnxEngine(default_bundle, top_k=5) as onnx:
        reference = onnx.classify(images)
    with OpenVinoEngine(default_bundle, top_k=5, threads=1, streams=3, max_batch=3) as engine:
        alone = engine.classify(images)
        chunks = [images[i:i + 4] for i in range(0, len(images), 4)]
        with ThreadPoolExecutor(3) as pool:
            together = [r for part in pool.map(engine.classify, chunks * 3) for r in part]
        assert engine.name == "openvino" and engine.stage_seconds["infer"] > 0
    assert [r.status for r in alone] == [r.status for r in reference]
    assert sum(r.status == "ok" for r in alone) >= len(photo_bytes)
    for a, b in zip(alone, reference):
        assert a.class_ids == b.class_ids and a.error == b.error and (a.width, a.height) == (b.width, b.height)
        np.testing.assert_allclose(a.scores, b.scores, atol=1e-4)
    for a, b in zip(together, alone * 3):
        assert a.class_ids == b.class_ids
        np.testing.assert_allclose(a.scores, b.scores, atol=1e-6)


def test_openvino_without_its_package_fails_in_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    from pipeline.engines.registry import engine_spec

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^--engine openvino needs the openvino package: pip install "
                                          r"'bulk-classify\[openvino\]', or use --engine onnx$"):
        engine_spec("openvino").check({})


def test_openvino_says_in_one_line_that_it_cannot_load_a_broken_model(default_bundle, tmp_path):
    from dataclasses import replace

    from pipeline.engines.openvino import OpenVinoEngine
    from pipeline.errors import EngineError

    broken = tmp_path / "model.onnx"
    broken.write_bytes(b"not a model")
    with pytest.raises(EngineError) as caught:
        OpenVinoEngine(replace(default_bundle, onnx_path=broken))
    message = str(caught.value)
    assert message.startswith(f"OpenVINO cannot load {broken}: ") and "\n" not in message
    assert message.endswith("; check the file with onnx.checker, or use --engine onnx")
    assert "Exception from" not in message
