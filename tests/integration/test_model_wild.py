"""Model folders as the tools users have write them: weights in ONNX external data, labels with a BOM or CRLF or in
UTF-16, a spec key written twice or NaN, probabilities declared on logits or log-probabilities, a channels-last fully
dynamic input, a gray input, a network answering NaN or infinity, a multi-label head, a timm checkpoint with EMA
weights, --top-k above the class count. Each gets the right rows on every engine, or one line on stderr before
anything is written, from `run` and `model check` alike (the same contract function)."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pyarrow.dataset as pads
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.config import RunConfig
from pipeline.engines.base import NONFINITE_ERROR
from pipeline.errors import ModelError, OutputError
from pipeline.model.folder import CACHE_ENV, LABELS_FILE, MODEL_FILE, SPEC_FILE, load_model, load_model_folder
from pipeline.model.imaging import load_and_preprocess
from support.every_engine import classify_everywhere
from support.odd_models import BRIGHT_IMAGES, CLASSES, EXTERNAL_DATA, SPEC, bright_images, model_folder
from support.paths import PHOTOS

PHOTO_NAMES = tuple(sorted(p.name for p in PHOTOS.glob("*.jpg")))
SHOP = ("shoe", "bag", "hat")


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [(PHOTOS / name).read_bytes() for name in PHOTO_NAMES]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """The triton engine's repositories go to this test's own model cache."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _run_refused(tmp_path: Path, folder: Path, *extra) -> str:
    """`bulk-classify run` with the model fails with one line on stderr, DEST exactly as it was; the line."""
    dest = tmp_path / "dest"
    dest.mkdir(exist_ok=True)
    (dest / "keep.txt").write_text("untouched")
    result = _cli("run", PHOTOS, "--output", dest, "--model", folder, *extra)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["keep.txt"] and (dest / "keep.txt").read_text() == "untouched"
    return lines[0]


def _check_refused(folder: Path) -> str:
    """`bulk-classify model check` refuses the folder in one line; the line."""
    result = _cli("model", "check", folder, "--engine", "onnx", "--sample", 2)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    return lines[0]


def _ort_logits(folder: Path, images: list[bytes]) -> np.ndarray:
    """ONNX Runtime's own outputs for the reference inputs of ``images``."""
    bundle = load_model(folder)
    session = ort.InferenceSession(str(folder / MODEL_FILE), providers=["CPUExecutionProvider"])
    x = np.stack([load_and_preprocess(data, bundle.spec)[0] for data in images])
    return session.run(None, {bundle.input_name: x})[0].astype(np.float64)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _rows(out: Path) -> dict[str, dict]:
    return {r["uri"].rsplit("/", 1)[-1]: r for r in pads.dataset(str(out), format="parquet").to_table().to_pylist()}


# Rows of engines that preprocess with Pillow (the reference) match ONNX Runtime to float rounding; DALI's resize
# (the gpu engine and the gpu profile) is not Pillow's to the last bit.
TOLERANCE = {"onnx": 1e-5, "openvino": 1e-5, "triton-portable": 1e-5, "gpu-cpu": 0.02, "triton-gpu-cpu": 0.02}


# ---- ONNX external data -------------------------------------------------------------------------------------


def test_external_weights_are_part_of_the_digest_and_a_missing_or_outside_location_is_refused(tmp_path):
    first = model_folder(tmp_path / "first", external=True, seed=1)
    second = model_folder(tmp_path / "second", external=True, seed=2)
    assert (first / MODEL_FILE).read_bytes() == (second / MODEL_FILE).read_bytes()  # only the weights differ
    a, b = load_model_folder(first), load_model_folder(second)
    assert a.digest != b.digest
    assert a.data_files == (EXTERNAL_DATA,)

    # A folder without external data hashes as it always has, so outputs written before keep their digest.
    inline = model_folder(tmp_path / "inline", seed=1)
    h = hashlib.sha256(b"bulk-classify model digest v1\n")
    h.update(f"{MODEL_FILE}\0{hashlib.sha256((inline / MODEL_FILE).read_bytes()).hexdigest()}\n".encode())
    h.update(b"model.torchscript\0-\n")
    h.update(json.dumps([f"product_{i}" for i in range(CLASSES)]).encode() + b"\n")
    h.update(json.dumps(load_model_folder(inline).spec.to_dict(), sort_keys=True).encode())
    assert load_model_folder(inline).digest == h.hexdigest() and load_model_folder(inline).data_files == ()

    (second / EXTERNAL_DATA).unlink()
    with pytest.raises(ModelError) as missing:
        load_model_folder(second)
    assert str(missing.value) == (f"{second / MODEL_FILE}: tensor 'w' keeps its data in '{EXTERNAL_DATA}', which is "
                                  f"not in {second}; copy {EXTERNAL_DATA} beside {MODEL_FILE} (it holds the model's "
                                  "weights)")

    import onnx

    model = onnx.load(str(first / MODEL_FILE), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../weights.bin"
    onnx.save(model, str(first / MODEL_FILE))
    shutil.copy(first / EXTERNAL_DATA, tmp_path / "weights.bin")
    with pytest.raises(ModelError) as outside:
        load_model_folder(first)
    assert str(outside.value) == (f"{first / MODEL_FILE}: tensor 'w' keeps its data at '../weights.bin', outside the "
                                  "model folder; save the model with its external data beside model.onnx (a relative "
                                  "location)")


def test_new_external_weights_in_the_same_folder_are_classified_again_never_carried(tmp_path, ray_local):
    folder = model_folder(tmp_path / "models" / "shop", external=True, seed=1)
    day1, day2 = tmp_path / "day1", tmp_path / "day2"
    assert run_job_counts(RunConfig(source=str(PHOTOS), output=str(day1), model=str(folder))) == (10, 0)
    old = load_model_folder(folder)
    shutil.copy(model_folder(tmp_path / "retrained", external=True, seed=7) / EXTERNAL_DATA, folder / EXTERNAL_DATA)
    new = load_model_folder(folder)
    assert new.digest != old.digest

    assert run_job_counts(RunConfig(source=str(PHOTOS), output=str(day2), model=str(folder),
                                    previous=str(day1))) == (10, 0)
    before, after = _rows(day1), _rows(day2)
    assert {r["model_digest"] for r in after.values()} == {new.digest}
    assert all(not r["carried"] for r in after.values())
    assert [after[n]["scores"] for n in PHOTO_NAMES] != [before[n]["scores"] for n in PHOTO_NAMES]
    with pytest.raises(OutputError, match=rf"holds rows of model 'shop' digest {old.short_digest}, not 'shop' digest "
                                          rf"{new.short_digest}"):
        run_job_counts(RunConfig(source=str(PHOTOS), output=str(day1), model=str(folder)))


def run_job_counts(config: RunConfig) -> tuple[int, int]:
    from pipeline.job import run_job

    summary = run_job(config)
    return summary.classified, summary.carried


def test_external_weights_load_on_every_engine_and_answer_as_inline_ones(tmp_path, photos):
    external = model_folder(tmp_path / "external", external=True, seed=3)
    expected = _softmax(_ort_logits(model_folder(tmp_path / "inline", seed=3), photos))
    rows = classify_everywhere(external, photos, tmp_path, top_k=CLASSES)
    assert set(rows) >= {"onnx", "triton-portable"}
    for engine, results in rows.items():
        for result, want in zip(results, expected):
            assert result.status == "ok", (engine, result.error)
            assert result.class_ids[0] == int(want.argmax()), engine
            assert result.scores == pytest.approx(sorted(want, reverse=True), abs=TOLERANCE[engine]), engine


def test_the_gpu_profile_repository_carries_the_external_data_file(tmp_path):
    from pipeline.triton import contract as tn
    from pipeline.triton.repository import add_topk_head, build_gpu_repository

    folder = model_folder(tmp_path / "external", external=True, classes=300)  # weights past onnx's 1 KB threshold
    repo = build_gpu_repository(str(folder), tmp_path / "repo", instances=1)
    version = repo / tn.MODEL_NAME / "1"
    assert (version / EXTERNAL_DATA).read_bytes() == (folder / EXTERNAL_DATA).read_bytes()
    head = add_topk_head(folder / MODEL_FILE, tmp_path / MODEL_FILE, k=2)
    assert (tmp_path / (MODEL_FILE + ".data")).stat().st_size > 3000 and head.stat().st_size < 1000  # still outside
    x = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)
    scores = ort.InferenceSession(str(head), providers=["CPUExecutionProvider"]).run(["SCORES"], {"image": x})[0]
    want = _softmax(ort.InferenceSession(str(folder / MODEL_FILE)).run(None, {"image": x})[0].astype(np.float64))
    np.testing.assert_allclose(scores, np.sort(want, axis=1)[:, ::-1][:, :2], atol=1e-6)


# ---- the output kind and the input layout: run and model check refuse alike --------------------------------


@pytest.mark.parametrize("kind, fix", [
    ("logits", "drop the field if they are logits"),
    ("log_softmax", "they are log-probabilities (a LogSoftmax): drop the field, and the softmax of logits scores them"),
])
def test_probabilities_declared_on_logits_or_log_probabilities_are_refused_by_run_and_model_check(tmp_path, kind,
                                                                                                  fix):
    folder = model_folder(tmp_path / kind, kind, spec={**SPEC, "output": "probabilities"})
    line = _run_refused(tmp_path, folder)
    assert re.fullmatch(rf'Error: {re.escape(str(folder / SPEC_FILE))} declares "output": "probabilities" but '
                        rf"{re.escape(str(folder / MODEL_FILE))}'s rows are not \(min -[\d.]+, a row sum off 1 by "
                        rf"[\d.]+\); {re.escape(fix)}", line), line
    assert _check_refused(folder) == line


def test_a_channels_last_network_with_a_fully_dynamic_input_is_named_by_run_and_model_check(tmp_path, photos):
    folder = model_folder(tmp_path / "nhwc", "nhwc_dynamic")
    line = _run_refused(tmp_path, folder)
    assert line == (f"Error: {folder / MODEL_FILE} fails on the spec's NCHW input and runs on NHWC: the network is "
                    f'channels last; set "layout": "NHWC" in {SPEC_FILE}')
    assert _check_refused(folder) == line
    (folder / SPEC_FILE).write_text(json.dumps({**SPEC, "layout": "NHWC"}))
    from pipeline.engines.onnx import OnnxEngine

    with OnnxEngine(load_model(folder), top_k=2) as engine:
        assert all(r.status == "ok" for r in engine.classify(photos[:3]))


def test_a_graph_that_ends_in_a_sigmoid_is_refused_with_the_fix(tmp_path):
    folder = model_folder(tmp_path / "sigmoid_head", "sigmoid", spec={**SPEC, "output": "sigmoid"})
    assert _run_refused(tmp_path, folder) == (
        f"Error: {folder / MODEL_FILE}: output 'logits' is a Sigmoid (independent per-class probabilities); export the "
        f'network without its final Sigmoid and set "output": "sigmoid" in {SPEC_FILE}: the engines apply the sigmoid')


# ---- non-finite numbers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, literal, problem", [
    ("mean", "NaN", "mean must have 3 values (one per channel) or one for all, finite numbers, got nan"),
    ("std", "Infinity", "std must have 3 values (one per channel) or one for all, finite numbers, got inf"),
    ("scale", "Infinity", "scale must be a positive finite number, got inf"),
])
def test_nan_or_infinity_in_the_spec_is_refused_in_one_line(tmp_path, field, literal, problem):
    folder = model_folder(tmp_path / field)
    text = json.dumps({k: v for k, v in SPEC.items() if k != field})
    (folder / SPEC_FILE).write_text(text[:-1] + f', "{field}": {literal}}}')
    assert _run_refused(tmp_path, folder) == f"Error: {folder / SPEC_FILE}: bad preprocessing spec: {problem}"


def test_a_non_finite_output_is_an_engine_error_row_on_every_engine(tmp_path, photos):
    folder = model_folder(tmp_path / "nonfinite", "nonfinite", seed=4)
    images = photos + list(bright_images().values())  # the photos finite, the light one infinite, the white one NaN
    expected = _softmax(_ort_logits(model_folder(tmp_path / "finite", seed=4), photos))
    assert not np.isfinite(_ort_logits(folder, images[len(photos):])).all(axis=1).any()
    rows = classify_everywhere(folder, images, tmp_path, top_k=3)
    assert set(rows) >= {"onnx", "triton-portable"}
    for engine, results in rows.items():
        for result in results[len(photos):]:
            assert (result.status, result.error, result.scores) == ("error", NONFINITE_ERROR, []), engine
        for result, want in zip(results, expected):
            assert result.status == "ok" and all(math.isfinite(s) for s in result.scores), engine
            assert result.scores == pytest.approx(sorted(want, reverse=True)[:3], abs=TOLERANCE[engine]), engine


def test_a_job_writes_non_finite_outputs_as_error_rows_and_refuses_a_network_that_is_never_finite(tmp_path,
                                                                                                 ray_local):
    from pipeline.job import run_job

    source = tmp_path / "src"
    shutil.copytree(PHOTOS, source)
    for name, data in bright_images().items():
        (source / name).write_bytes(data)
    folder = model_folder(tmp_path / "nonfinite", "nonfinite")
    summary = run_job(RunConfig(source=str(source), output=str(tmp_path / "out"), model=str(folder)))
    assert summary.counts == {"ok": 10, "error": 2}
    rows = _rows(tmp_path / "out")
    assert sorted(n for n, r in rows.items() if r["status"] == "error") == sorted(BRIGHT_IMAGES)
    assert {rows[n]["error"] for n in BRIGHT_IMAGES} == {NONFINITE_ERROR}
    assert all(not any(math.isnan(s) for s in r["scores"]) for r in rows.values())
    check = _cli("model", "check", folder, "--engine", "onnx", "--images", source)
    assert check.exit_code == 1 and f"2 of 12 images failed: {NONFINITE_ERROR}" in check.stdout

    never = model_folder(tmp_path / "never", "nonfinite", spec={**SPEC, "mean": [-1.0, -1.0, -1.0]})
    line = _run_refused(tmp_path, never)
    assert line == (f"Error: {never / MODEL_FILE} returns NaN or infinity for every one of the 2 sample images; "
                    "check its weights and its export (an FP16 export that overflows?)")
    assert _check_refused(never) == line


# ---- labels and spec as editors write them -------------------------------------------------------------------


def test_labels_and_spec_with_a_bom_crlf_or_utf16_are_read_as_written(tmp_path, photos):
    plain = load_model_folder(model_folder(tmp_path / "plain"))
    names = [f"product_{i}" for i in range(CLASSES)]
    bom = model_folder(tmp_path / "bom", labels="\ufeff" + "".join(f"{n}\r\n" for n in names))
    utf16 = model_folder(tmp_path / "utf16")
    (utf16 / LABELS_FILE).write_bytes("".join(f"{n}\r\n" for n in names).encode("utf-16"))  # PowerShell's >
    (utf16 / SPEC_FILE).write_bytes(b"\xef\xbb\xbf" + json.dumps(SPEC).encode())  # Notepad's UTF-8 with a BOM
    for folder in (bom, utf16):
        bundle = load_model_folder(folder)
        assert bundle.labels == tuple(names) and bundle.digest == plain.digest
    from pipeline.engines.onnx import OnnxEngine

    with OnnxEngine(load_model_folder(bom), top_k=CLASSES) as engine:
        assert {label for r in engine.classify(photos) for label in r.labels} == set(names)


def test_a_label_written_twice_is_refused_in_one_line(tmp_path):
    folder = model_folder(tmp_path / "dup", labels="cat\ndog\ncat\nbird\nfish\n")
    assert _run_refused(tmp_path, folder) == (f"Error: {folder / LABELS_FILE} names 'cat' twice (lines 1 and 3); give "
                                              "every class its own name, e.g. 'crane (bird)' and 'crane (machine)'")


def test_a_spec_key_written_twice_is_refused_naming_it(tmp_path):
    folder = model_folder(tmp_path / "twice")
    (folder / SPEC_FILE).write_text(json.dumps(SPEC)[:-1] + ', "interpolation": "nearest", "antialias": false}')
    assert _run_refused(tmp_path, folder) == (f"Error: {folder / SPEC_FILE}: bad preprocessing spec: 'interpolation' is "
                                              "written twice (JSON keeps the last one silently); keep one")


def test_a_gray_network_is_refused_saying_that_images_are_fed_as_rgb(tmp_path):
    folder = model_folder(tmp_path / "gray", "gray")
    assert _run_refused(tmp_path, folder) == (
        f"Error: {folder / MODEL_FILE}: input 'image' has shape [?, 1, 32, 32] but preprocess.json makes "
        "[?, 3, 32, 32] (NCHW, crop [32, 32]); the model takes 1 channel (grayscale) and bulk-classify feeds 3 (RGB) "
        "only; export it with a 3-channel input (for a gray network, a first layer that turns RGB into gray, e.g. "
        "0.299 R + 0.587 G + 0.114 B)")


# ---- multi-label models --------------------------------------------------------------------------------------


def test_sigmoid_scores_each_class_alone_on_every_engine_and_passes_model_check(tmp_path, photos):
    folder = model_folder(tmp_path / "multi", spec={**SPEC, "output": "sigmoid"}, seed=5)
    expected = 1 / (1 + np.exp(-_ort_logits(folder, photos)))
    rows = classify_everywhere(folder, photos, tmp_path, top_k=3)
    assert set(rows) >= {"onnx", "triton-portable"}
    for engine, results in rows.items():
        for result, want in zip(results, expected):
            assert result.status == "ok", (engine, result.error)
            assert result.class_ids == list(np.argsort(-want, kind="stable")[:3]), engine
            assert result.scores == pytest.approx(sorted(want, reverse=True)[:3], abs=TOLERANCE[engine]), engine
    assert expected.sum(axis=1).min() > 1.5  # independent scores: no softmax made them sum to 1
    check = _cli("model", "check", folder, "--engine", "onnx", "--engine", "openvino")
    assert check.exit_code == 0, check.output
    assert [line.split()[0] for line in check.stdout.splitlines() if line.endswith(" ok")] == ["onnx", "openvino"]


def test_a_multi_label_hugging_face_model_is_imported_with_sigmoid_scores(tmp_path, photos):
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    from pipeline.model_import.core import format_result, import_model

    torch.manual_seed(0)
    source = tmp_path / "hf"
    config = ViTConfig(image_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                       initializer_range=0.2, num_labels=3, id2label=dict(enumerate(SHOP)),
                       label2id={s: i for i, s in enumerate(SHOP)}, problem_type="multi_label_classification")
    ViTForImageClassification(config).save_pretrained(source)
    ViTImageProcessor(size={"height": 64, "width": 64}).save_pretrained(source)
    result = import_model("huggingface", str(source), tmp_path / "model")
    assert result.spec.output == "sigmoid"
    assert json.loads((tmp_path / "model" / SPEC_FILE).read_text())["output"] == "sigmoid"
    assert ('note: scores: "output": "sigmoid", a sigmoid per class (problem_type multi_label_classification)'
            in format_result(result).splitlines())
    from pipeline.engines.onnx import OnnxEngine

    want = 1 / (1 + np.exp(-_ort_logits(result.folder, photos)))
    with OnnxEngine(load_model(result.folder), top_k=3) as engine:
        rows = engine.classify(photos)
    assert [r.scores for r in rows] == [pytest.approx(sorted(w, reverse=True), abs=1e-6) for w in want]


# ---- timm checkpoints with EMA weights ---------------------------------------------------------------------


def test_a_timm_checkpoint_with_ema_weights_says_which_it_took_and_takes_either(tmp_path):
    import timm
    import torch

    torch.manual_seed(0)
    trained, ema = timm.create_model("test_resnet", num_classes=3), timm.create_model("test_resnet", num_classes=3)
    checkpoint = tmp_path / "model_best.pth.tar"  # timm's train.py with --model-ema
    torch.save({"state_dict": trained.state_dict(), "state_dict_ema": ema.state_dict(), "class_names": SHOP,
                "args": argparse.Namespace(model="test_resnet"), "epoch": 9}, checkpoint)
    probe = np.random.default_rng(0).standard_normal((2, 3, 160, 160)).astype(np.float32)
    for flags, network, note in (
            ((), trained, "note: weights: the checkpoint's state_dict; it also holds EMA weights (state_dict_ema): "
                          "--use-ema imports those instead"),
            (("--use-ema",), ema, "note: weights: the checkpoint's EMA weights (state_dict_ema), as asked by "
                                  "--use-ema")):
        out = tmp_path / ("ema" if flags else "trained")
        result = _cli("model", "import", "timm", "test_resnet", "--checkpoint", checkpoint, "--output", out, *flags)
        assert result.exit_code == 0, result.output
        assert note in result.stdout.splitlines()
        session = ort.InferenceSession(str(out / MODEL_FILE), providers=["CPUExecutionProvider"])
        with torch.no_grad():
            want = network.eval()(torch.from_numpy(probe)).numpy()
        np.testing.assert_allclose(session.run(None, {"input": probe})[0], want, atol=1e-4)

    plain = tmp_path / "plain.pth"
    torch.save(trained.state_dict(), plain)
    refused = _cli("model", "import", "timm", "test_resnet", "--checkpoint", plain, "--labels", _labels(tmp_path),
                   "--output", tmp_path / "nope", "--use-ema")
    assert refused.exit_code == 1 and not (tmp_path / "nope").exists()
    assert refused.stderr.strip() == (f"Error: --use-ema: {plain} holds no EMA weights (state_dict_ema or model_ema); "
                                      "drop --use-ema to import its trained weights")


def _labels(tmp_path: Path) -> Path:
    path = tmp_path / "shop.txt"
    path.write_text("\n".join(SHOP) + "\n")
    return path


# ---- --top-k above the class count ---------------------------------------------------------------------------


def test_top_k_above_the_class_count_writes_every_class_with_one_note_on_the_triton_engine(tmp_path, ray_local,
                                                                                           caplog):
    from pipeline.job import run_job

    folder = model_folder(tmp_path / "three", classes=3, seed=6)
    with caplog.at_level("WARNING"):
        summary = run_job(RunConfig(source=str(PHOTOS), output=str(tmp_path / "out"), model=str(folder),
                                    engine="triton", top_k=5))
    assert summary.counts == {"ok": 10, "error": 0}
    notes = [r.getMessage() for r in caplog.records if "--top-k" in r.getMessage()]
    assert notes == ["--top-k 5 is more than the 3 classes of model 'three': each row holds all 3, best first"]
    want = _softmax(_ort_logits(folder, [(PHOTOS / n).read_bytes() for n in PHOTO_NAMES]))
    rows = _rows(tmp_path / "out")
    for name, probs in zip(PHOTO_NAMES, want):
        assert rows[name]["scores"] == pytest.approx(sorted(probs, reverse=True), abs=1e-5)
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text())["options"]["top_k"] == 3
