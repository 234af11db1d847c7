"""`bulk-classify model quantize` on small samples of real photos: the model it writes, and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from pipeline.cli import main
from pipeline.errors import ConfigError
from support.paths import PHOTOS

CAT_CLASSES = {"tabby", "tiger cat", "Egyptian cat", "Persian cat", "lynx"}


def make_crops(root: Path, count: int, *, photos: list[str] | None = None, scale=(0.5, 1.0), size=(320, 240)) -> Path:
    """``count`` JPEG crops of the committed photos (or of ``photos`` only), seeded by their index."""
    sources = [Image.open(p).convert("RGB") for p in sorted(PHOTOS.glob("*.jpg")) if not photos or p.stem in photos]
    root.mkdir(parents=True)
    for i in range(count):
        rng = np.random.default_rng(i)
        src = sources[i % len(sources)]
        w, h = size if i % 3 else size[::-1]
        box_w = min(src.width, src.height * w / h) * rng.uniform(*scale)
        box_h = box_w * h / w
        left, top = rng.uniform(0, src.width - box_w), rng.uniform(0, src.height - box_h)
        src.resize((w, h), Image.Resampling.BICUBIC, box=(left, top, left + box_w, top + box_h)).save(
            root / f"{i:04d}.jpg", quality=88)
    return root


@pytest.fixture(scope="module")
def cli_env(model_cache):
    return {"BULK_CLASSIFY_CACHE_DIR": str(model_cache)}


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory, cli_env, default_bundle):
    """A forced INT8 build calibrated on 16 crops and gated on 120 others: (folder, CLI result)."""
    tmp = tmp_path_factory.mktemp("quantize")
    src = make_crops(tmp / "photos", 136)
    out = tmp / "lite0-int8"
    result = CliRunner().invoke(main, ["model", "quantize", "--calibration", str(src), "--output", str(out),
                                       "--samples", "136", "--calibration-images", "16", "--method", "minmax",
                                       "--force"], env=cli_env)
    return out, result


def test_quantize_writes_a_model_folder_that_loads_as_int8_and_classifies(int8_model, photo_bytes):
    from pipeline.engines.onnx import OnnxEngine
    from pipeline.model.folder import load_model

    out, result = int8_model
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["int8_gate.json", "labels.txt", "model.onnx", "preprocess.json"]
    report = json.loads((out / "int8_gate.json").read_text())
    assert report["forced"] is (not report["passed"])
    assert report["sample"]["calibration_images"] == 16 and report["sample"]["held_out_images"] == 120
    assert report["method"]["tool"] == "onnxruntime.quantization.quantize_static"
    assert report["method"]["types"] == "u8s8"  # the defaults: only the classifier in float
    assert report["method"]["exclude"] == ["classifier"]
    assert report["method"]["nodes_to_exclude"] == ["fc"]
    f = report["figures"]
    assert f["images"] == 120 and 0 < f["top1_agreement"] <= 1 and 0 < f["top5_overlap"] <= 1
    # FP32 against itself with half a pixel level of noise: near-ties flip, most images do not
    assert 0.5 < f["fp32_pixel_noise"]["top1_agreement"] < 1 and f["fp32_pixel_noise"]["decisive_agreement"] > 0.9
    assert "half a pixel level" in result.output
    assert ("passed" if report["passed"] else "FAILED") in result.output.splitlines()[-1]
    bundle = load_model(out)
    assert bundle.precision == "int8"
    with OnnxEngine(bundle, top_k=5, decode_threads=2, intra_op_threads=1) as engine:
        (cat,) = engine.classify([photo_bytes["chelsea"]])
    assert cat.status == "ok" and set(cat.labels[:2]) & CAT_CLASSES, cat.labels


def test_a_calibration_set_of_one_kind_of_image_is_refused_in_one_line(tmp_path, cli_env, default_bundle):
    src = make_crops(tmp_path / "cats", 140, photos=["chelsea"], scale=(0.9, 1.0))
    out = tmp_path / "int8"
    result = CliRunner().invoke(main, ["model", "quantize", "--calibration", str(src), "--output", str(out),
                                       "--samples", "140", "--calibration-images", "16"], env=cli_env)
    assert result.exit_code == 3, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("Error: INT8 gate failed, no model written: ")
    assert "of the held-out images are one class" in line
    assert not out.exists()
    side = json.loads((tmp_path / "int8.int8_gate.json").read_text())
    assert side["passed"] is False and side["figures"]["largest_class_share"] > 0.5


def test_ten_images_are_refused_before_any_work(tmp_path, cli_env):
    src = make_crops(tmp_path / "ten", 10)
    out = tmp_path / "int8"
    result = CliRunner().invoke(main, ["model", "quantize", "--calibration", str(src), "--output", str(out)],
                                env=cli_env)
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: {src} has 10 images (10 sampled), not more than --calibration-images 192: a held-out part is "
        "needed too; give a folder of at least 292 ordinary photos"]
    assert not out.exists() and not (tmp_path / "int8.int8_gate.json").exists()


def test_an_existing_output_is_left_as_it_was(tmp_path, cli_env):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = CliRunner().invoke(main, ["model", "quantize", "--calibration", str(PHOTOS), "--output", str(out)],
                                env=cli_env)
    assert result.exit_code == 1
    assert result.output.strip() == (f"Error: --output {out} already exists and is not an empty folder; remove it "
                                     "or choose another folder")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_gpu_paths_refuse_an_int8_model_and_say_where_it_runs(int8_model, tmp_path, cli_env):
    from pipeline.engines.registry import engine_spec
    from pipeline.model.folder import load_model

    out, _ = int8_model
    bundle = load_model(out)
    with pytest.raises(ConfigError, match=r"is INT8 and --engine gpu has no INT8 on the GPU paths without TensorRT; "
                                          r"use --engine onnx, or --engine triton with the portable profile"):
        engine_spec("gpu").check_model(bundle)
    engine_spec("onnx").check_model(bundle)
    engine_spec("openvino").check_model(bundle)
    engine_spec("triton").check_model(bundle)
    result = CliRunner().invoke(main, ["repo", "build", "--profile", "gpu", "--model", str(out), "--output",
                                       str(tmp_path / "repo")], env=cli_env)
    assert result.exit_code == 1
    assert "is an INT8 model and the gpu profile has no INT8 on the GPU paths without TensorRT" in result.output
    engines = CliRunner().invoke(main, ["engines"]).output
    assert "  INT8 models: none (no INT8 on the GPU paths without TensorRT); use --engine onnx" in engines
    assert "  INT8 models: with the portable profile (ONNX Runtime); the gpu profile has no INT8" in engines
    assert "  INT8 models: yes (OpenVINO's integer kernels, faster than onnx's on an AMX Xeon)" in engines


def test_openvino_runs_the_int8_model(int8_model, photo_bytes):
    from pipeline.engines.openvino import OpenVinoEngine
    from pipeline.model.folder import load_model

    with OpenVinoEngine(load_model(int8_model[0]), top_k=5, threads=1, streams=1) as engine:
        results = engine.classify(list(photo_bytes.values()))
    assert [r.status for r in results] == ["ok"] * len(photo_bytes)
    assert all(0 < r.scores[0] <= 1 and len(r.class_ids) == 5 for r in results)
    assert set(results[list(photo_bytes).index("chelsea")].labels[:2]) & CAT_CLASSES


def test_quantize_has_help():
    result = CliRunner().invoke(main, ["model", "quantize", "--help"])
    assert result.exit_code == 0
    assert "--calibration SOURCE" in result.output and "--force" in result.output
