"""A model is its content: resume, carry-over, the gpu engine's built-in network and the Triton repository cache
follow the model digest (its files, labels and spec), never its folder's name."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pytest

from pipeline.config import RunConfig
from pipeline.errors import OutputError
from pipeline.job import run_job
from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE, TORCHSCRIPT_FILE, is_builtin, load_model_folder
from support.paths import DATA

PHOTOS = DATA / "photos"
LEGACY_OUTPUT = DATA / "legacy_output"  # written by the release before digests: s3://legacy-photos/photos, built-in
LEGACY_BUCKET, LEGACY_PREFIX = "legacy-photos", "photos"
CLASSES = 37
SIZE = 32
TORCHVISION_SPEC = {"resize_shorter": SIZE, "crop": [SIZE, SIZE], "interpolation": "bilinear",
                    "scale": 1 / 255, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def write_model(folder: Path, *, seed: int, classes: int = CLASSES) -> Path:
    """A real 37-class ONNX classifier (mean colour -> Gemm; its answers depend on its weights) with a dynamic batch
    axis, its labels and its spec: ``seed`` stands for a training run."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    weight = numpy_helper.from_array(rng.normal(0, 4, (classes, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.normal(0, 1, classes).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["image"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["flat"]),
         helper.make_node("Gemm", ["flat", "w", "b"], ["logits"], transB=1)],
        "tiny", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])], [weight, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / MODEL_FILE))
    (folder / LABELS_FILE).write_text("".join(f"product_{i:02d}\n" for i in range(classes)))
    (folder / SPEC_FILE).write_text(json.dumps(TORCHVISION_SPEC))
    return folder


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def rows(out: Path) -> dict[str, dict]:
    table = pads.dataset(str(out), format="parquet").to_table(columns=["uri", "labels", "model", "model_digest",
                                                                         "carried"])
    return {r["uri"]: r for r in table.to_pylist()}


def test_a_retrained_model_in_the_same_folder_is_reclassified_and_the_same_files_elsewhere_are_carried(
        tmp_path, ray_local):
    prod = write_model(tmp_path / "models" / "prod", seed=1)
    first = load_model_folder(prod)
    day1, day2, day3 = tmp_path / "day1", tmp_path / "day2", tmp_path / "day3"
    assert run_job(RunConfig(source=str(PHOTOS), output=str(day1), model=str(prod))).classified == 10
    assert {r["model_digest"] for r in rows(day1).values()} == {first.digest}
    assert json.loads((day1 / "_SUCCESS").read_text())["model_digest"] == first.digest
    assert json.loads((day1 / "_REPORT.json").read_text())["model_digest"] == first.digest

    write_model(prod, seed=2)  # retrained: same folder name, new weights
    second = load_model_folder(prod)
    assert second.name == first.name and second.digest != first.digest
    before = tree_digest(day1)
    with pytest.raises(OutputError, match=rf"holds rows of model 'prod' digest {first.short_digest}, not 'prod' "
                                          rf"digest {second.short_digest} .*pass --overwrite"):
        run_job(RunConfig(source=str(PHOTOS), output=str(day1), model=str(prod)))
    assert tree_digest(day1) == before  # refused in the driver: the output exactly as it was

    summary = run_job(RunConfig(source=str(PHOTOS), output=str(day2), model=str(prod), previous=str(day1)))
    assert (summary.classified, summary.carried) == (10, 0)  # yesterday's answers were another model's
    day2_rows = rows(day2)
    assert {r["model_digest"] for r in day2_rows.values()} == {second.digest}
    assert [r["labels"] for r in day2_rows.values()] != [rows(day1)[u]["labels"] for u in day2_rows]

    elsewhere = tmp_path / "models" / "prod-copy"
    shutil.copytree(prod, elsewhere)  # the same model under another folder name
    summary = run_job(RunConfig(source=str(PHOTOS), output=str(day3), model=str(elsewhere), previous=str(day2)))
    assert (summary.classified, summary.carried) == (0, 10)
    day3_rows = rows(day3)
    assert all(r["carried"] and r["model_digest"] == second.digest for r in day3_rows.values())
    assert {u: r["labels"] for u, r in day3_rows.items()} == {u: r["labels"] for u, r in day2_rows.items()}


@pytest.fixture
def legacy_source(s3):
    """The objects the committed legacy output was written from, on moto's S3 (same keys, bytes, so same ETags)."""
    s3.create_bucket(Bucket=LEGACY_BUCKET)
    for path in sorted(PHOTOS.glob("*.jpg")):
        s3.put_object(Bucket=LEGACY_BUCKET, Key=f"{LEGACY_PREFIX}/{path.name}", Body=path.read_bytes())
    return f"s3://{LEGACY_BUCKET}/{LEGACY_PREFIX}"


def test_an_output_written_before_digests_still_resumes_and_carries_over_with_the_built_in_model(
        tmp_path, legacy_source, ray_local):
    record = json.loads((LEGACY_OUTPUT / "_RUN.json").read_text())
    assert "model_digest" not in record  # what the earlier release wrote
    previous = shutil.copytree(LEGACY_OUTPUT, tmp_path / "previous")
    summary = run_job(RunConfig(source=legacy_source, output=str(tmp_path / "next"), previous=str(previous)))
    assert (summary.classified, summary.carried) == (0, 10)

    interrupted = shutil.copytree(LEGACY_OUTPUT, tmp_path / "interrupted")
    (interrupted / "_SUCCESS").unlink()  # a run of that release that stopped before completing
    summary = run_job(RunConfig(source=legacy_source, output=str(interrupted)))
    assert (summary.already_done, summary.classified, summary.total) == (10, 0, 10)

    assert json.loads((interrupted / "_SUCCESS").read_text())["model_digest"] == summary.report["model_digest"]

    prod = write_model(tmp_path / "prod", seed=1)  # a user's model cannot be told apart in such an output
    other = shutil.copytree(LEGACY_OUTPUT, tmp_path / "other")
    before = tree_digest(other)
    with pytest.raises(OutputError, match="'efficientnet-lite0' written before model digests were recorded"):
        run_job(RunConfig(source=legacy_source, output=str(other), model=str(prod)))
    assert tree_digest(other) == before


def test_the_built_in_network_is_recognised_by_digest_never_by_folder_name(tmp_path, default_bundle):
    assert is_builtin(default_bundle)
    copy = shutil.copytree(Path(default_bundle.onnx_path).parent, tmp_path / "custom-name")
    assert is_builtin(load_model_folder(copy))  # the same files under another name: the same model

    fine_tuned = write_model(tmp_path / "efficientnet-lite0", seed=3)  # a user's model named like the built-in
    bundle = load_model_folder(fine_tuned)
    assert bundle.name == default_bundle.name and not is_builtin(bundle)
    spec = json.loads((copy / SPEC_FILE).read_text())
    (copy / SPEC_FILE).write_text(json.dumps({**spec, "interpolation": "bilinear"}))
    assert not is_builtin(load_model_folder(copy))  # the built-in network under another spec answers otherwise


def test_the_triton_repository_cache_follows_every_file_that_decides_the_answers(tmp_path):
    from pipeline.triton.profiles import PROFILES
    from pipeline.triton.repository_cache import cached_repository

    portable = PROFILES["portable"]
    folder = write_model(tmp_path / "model", seed=1)
    built = cached_repository(portable, load_model_folder(folder), top_k=5, cache_dir=tmp_path / "cache")
    (folder / SPEC_FILE).write_text(json.dumps({**TORCHVISION_SPEC, "interpolation": "bicubic"}))
    respec = cached_repository(portable, load_model_folder(folder), top_k=5, cache_dir=tmp_path / "cache")
    assert respec != built
    served = [json.loads(p.read_text()) for p in respec.rglob(SPEC_FILE)]
    assert served and all(s["interpolation"] == "bicubic" for s in served)  # the new spec is what is served
    digest = load_model_folder(folder).digest
    (folder / TORCHSCRIPT_FILE).write_bytes(b"another network file an engine loads")
    assert load_model_folder(folder).digest != digest
    assert cached_repository(portable, load_model_folder(folder), top_k=5, cache_dir=tmp_path / "cache") != respec


def test_a_label_count_is_checked_against_a_class_axis_the_file_leaves_unnamed(tmp_path):
    import onnx

    from pipeline.errors import ModelError

    folder = write_model(tmp_path / "model", seed=1)
    model = onnx.load(str(folder / MODEL_FILE))
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_param = "classes"  # as some exporters write it
    onnx.save(model, str(folder / MODEL_FILE))
    assert load_model_folder(folder).num_classes == CLASSES
    (folder / LABELS_FILE).write_text("".join(f"c{i}\n" for i in range(CLASSES - 1)))
    with pytest.raises(ModelError, match=f"has {CLASSES - 1} labels but the model outputs {CLASSES} classes"):
        load_model_folder(folder)
