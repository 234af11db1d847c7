"""docs/api.md's examples, run as written: a job from Python on the committed photos, and ``Classifier`` inside a user's
``map_batches`` over a Parquet file of URIs on a real S3 endpoint (moto) and over bytes, on a local Ray."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from conftest import PHOTOS

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
BUCKET = "api-docs"


def examples() -> list[str]:
    """The ```python blocks of docs/api.md, in order."""
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def run_example(code: str, **paths: str) -> dict:
    """Execs one example with its placeholder paths replaced (each must occur: a renamed one fails here)."""
    for placeholder, path in paths.items():
        assert placeholder in code, f"docs/api.md's example no longer uses {placeholder!r}"
        code = code.replace(placeholder, path)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the documented examples are the test
    return namespace


@pytest.fixture(scope="module")
def onnx_labels(onnx_engine) -> dict[str, list[str]]:
    """The onnx engine's top-5 labels per committed photo (its file name)."""
    photos = sorted(PHOTOS.glob("*.jpg"))
    results = onnx_engine.classify([p.read_bytes() for p in photos])
    assert all(r.status == "ok" for r in results)
    return {p.name: r.labels for p, r in zip(photos, results)}


def test_the_docs_have_the_examples_this_test_runs():
    assert len(examples()) == 4


def test_run_a_job_from_python_returns_its_counts(tmp_path, ray_local, onnx_labels):
    src, out = tmp_path / "photos", tmp_path / "labels"
    shutil.copytree(PHOTOS, src)
    first, second = examples()[:2]
    paths = {'"photos/"': repr(str(src)), '"labels/"': repr(str(out))}

    result = run_example(first, **paths)["result"]

    n = len(onnx_labels)
    assert (result.rows, result.ok, result.errors, result.classified) == (n, n, 0, n)
    assert (result.carried, result.already_done, result.list_errors, dict(result.error_kinds)) == (0, 0, 0, {})
    assert result.output == str(out) and result.elapsed_s > 0
    with pytest.raises(AttributeError):
        result.rows = 0  # frozen
    rows = pads.dataset(str(out), format="parquet").to_table().to_pylist()
    assert {r["uri"].rsplit("/", 1)[-1]: r["labels"] for r in rows} == onnx_labels

    again = run_example(second, **paths)["again"]  # the keyword form, on the same output: a resume
    assert (again.rows, again.ok, again.classified, again.already_done) == (n, n, 0, n)


def test_classifier_in_a_users_map_batches_over_uris_on_s3(s3, ray_local, onnx_labels):
    import s3fs

    s3.create_bucket(Bucket=BUCKET)
    uris, ids = [], []
    for i, photo in enumerate(sorted(PHOTOS.glob("*.jpg"))):
        s3.put_object(Bucket=BUCKET, Key=f"photos/{photo.name}", Body=photo.read_bytes())
        uris.append(f"s3://{BUCKET}/photos/{photo.name}")
        ids.append(i)
    s3.put_object(Bucket=BUCKET, Key="photos/notes.jpg", Body=b"not an image")
    uris += [f"s3://{BUCKET}/photos/notes.jpg", f"s3://{BUCKET}/photos/missing.jpg", None]
    ids += [100, 101, 102]
    fs = s3fs.S3FileSystem()
    with fs.open(f"{BUCKET}/uris.parquet", "wb") as f:
        pq.write_table(pa.table({"uri": pa.array(uris, pa.string()), "item_id": ids}), f)

    run_example(examples()[2], **{"my-bucket": BUCKET})

    fs.invalidate_cache()
    table = pads.dataset(f"{BUCKET}/labels/", format="parquet", filesystem=fs).to_table()
    assert table.num_rows == len(uris)
    assert {"uri", "item_id", "status", "error", "labels", "scores", "class_ids", "model_digest"} <= set(
        table.column_names)
    by_id = {r["item_id"]: r for r in table.to_pylist()}
    assert sorted(by_id) == sorted(ids)  # the user's column passes through, one row per input
    for i, photo in enumerate(sorted(PHOTOS.glob("*.jpg"))):
        row = by_id[i]
        assert row["uri"] == uris[i] and row["status"] == "ok" and row["error"] is None, row
        assert row["labels"] == onnx_labels[photo.name] and len(row["scores"]) == 5
        assert row["scores"] == sorted(row["scores"], reverse=True)
    assert by_id[100]["status"] == "error" and by_id[100]["error"].startswith("unsupported:"), by_id[100]
    assert by_id[101]["status"] == "error" and by_id[101]["error"].startswith("not_found:"), by_id[101]
    assert by_id[102]["status"] == "error" and by_id[102]["error"].startswith("not_found:"), by_id[102]
    assert by_id[101]["labels"] is None and by_id[101]["uri"] == uris[-2]


def test_classifier_over_bytes_from_read_binary_files(tmp_path, ray_local, onnx_labels):
    src = tmp_path / "photos"
    src.mkdir()
    for photo in PHOTOS.glob("*.jpg"):
        shutil.copy(photo, src / photo.name)
    (src / "broken.jpg").write_bytes((PHOTOS / "coffee.jpg").read_bytes()[:200])

    rows = run_example(examples()[3], **{'"photos/"': repr(str(src))})["rows"]

    by_name = {row["path"].rsplit("/", 1)[-1]: row for row in rows}
    assert len(rows) == len(onnx_labels) + 1
    for name, labels in onnx_labels.items():
        assert by_name[name]["status"] == "ok" and by_name[name]["labels"] == labels
    assert by_name["broken.jpg"]["status"] == "error" and by_name["broken.jpg"]["error"], by_name["broken.jpg"]

    # Ray's default batch format (numpy) gives the same rows
    from pipeline import Classifier

    numpy_rows = ray_local.data.read_binary_files(str(src), include_paths=True).map_batches(
        Classifier, concurrency=1, batch_size=16).take_all()
    numpy_by_name = {row["path"].rsplit("/", 1)[-1]: row for row in numpy_rows}
    assert sorted(numpy_by_name) == sorted(by_name)
    for name, row in numpy_by_name.items():
        assert (row["status"], row["error"]) == (by_name[name]["status"], by_name[name]["error"]), name
        assert list(row["labels"]) == list(by_name[name]["labels"]), name


def test_classifier_keeps_each_batch_format_and_passes_other_columns_through():
    """The same classifier on pyarrow, pandas and numpy batches (no Ray: the class itself)."""
    import numpy as np

    from pipeline import Classifier
    from pipeline.errors import ConfigError

    data = (PHOTOS / "chelsea.jpg").read_bytes()
    classifier = Classifier(top_k=3)
    try:
        table = classifier(pa.table({"bytes": [data, None], "k": [1, 2]}))
        assert table.column("k").to_pylist() == [1, 2] and table.column("status").to_pylist() == ["ok", "error"]
        assert table.column("error").to_pylist()[1] == "empty: the 'bytes' column is null"
        assert len(table.column("labels")[0]) == 3 and table.schema.field("scores").type == pa.list_(pa.float32())
        frame = classifier(table.select(["bytes", "k"]).to_pandas())
        assert list(frame["k"]) == [1, 2] and list(frame["labels"][0]) == table.column("labels")[0].as_py()
        batch = classifier({"bytes": np.array([data], dtype=object), "k": np.array([7])})
        assert batch["k"].tolist() == [7] and batch["status"].tolist() == ["ok"]
        with pytest.raises(ConfigError, match="neither a 'uri' column"):
            classifier(pa.table({"k": [1]}))
    finally:
        classifier.close()


def test_classifier_runs_any_registered_engine_by_name_with_its_options():
    from pipeline import Classifier
    from pipeline.errors import ConfigError

    batch = pa.table({"uri": [str(PHOTOS / "chelsea.jpg"), str(PHOTOS / "no-such.jpg")]})  # local paths
    onnx = Classifier(engine="onnx", top_k=3, engine_options={"intra_op_threads": 1})
    openvino = Classifier(engine="openvino", top_k=3, engine_options={"threads": 1})
    try:
        a, b = onnx(batch), openvino(batch)
        assert a.column("engine").to_pylist() == ["onnx"] * 2 and b.column("engine").to_pylist() == ["openvino"] * 2
        assert a.column("labels")[0].as_py()[0] == b.column("labels")[0].as_py()[0] == "Egyptian cat"
        assert b.column("status").to_pylist() == ["ok", "error"] and b.column("error")[1].as_py().startswith(
            "not_found:")
    finally:
        onnx.close()
        openvino.close()
    default = Classifier(top_k=3)  # the CLI's default engine, auto: onnx on a machine without a GPU
    try:
        assert default(batch).column("engine").to_pylist() == ["onnx"] * 2
    finally:
        default.close()
    with pytest.raises(ConfigError, match="has no option nope"):
        Classifier(engine="onnx", engine_options={"nope": 1})


def test_classifier_runs_a_users_model_folder(tmp_path, default_bundle):
    """``model=DIR`` as ``--model DIR``: the folder's labels and digest, not the built-in model's."""
    from pipeline import Classifier

    folder = tmp_path / "my-model"
    shutil.copytree(default_bundle.onnx_path.parent, folder)
    labels = (folder / "labels.txt").read_text().splitlines()
    (folder / "labels.txt").write_text("".join(f"item {i}: {label}\n" for i, label in enumerate(labels)))
    classifier = Classifier(model=folder, top_k=1)
    try:
        table = classifier(pa.table({"bytes": [(PHOTOS / "chelsea.jpg").read_bytes()]}))
    finally:
        classifier.close()
    [row] = table.to_pylist()
    assert row["labels"] == [f"item {row['class_ids'][0]}: Egyptian cat"]
    assert row["model_digest"] == classifier.model_digest != default_bundle.digest
