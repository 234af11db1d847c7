"""docs/output.md's "Several models", run as written: its commands through the CLI on a local Ray (the built-in model
and small model folders, on the committed photos), then exactly its DuckDB and pyiceberg queries, each answer checked
against the Parquet rows; the Iceberg table takes the set's schema, refuses another's, and keeps an embedding; and an
embedding column in DuckDB's vector search, checked against numpy and ONNX Runtime."""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from conftest import PHOTOS
from pipeline.schema import EMBEDDING as EMBEDDING_COLUMN
from support.embedding_models import DIM, EMBEDDING, embedding_folder
from support.odd_models import model_folder
from support.paths import REPO

DOC = REPO / "docs" / "output.md"
TITLE = "## Several models"
PARITY = REPO / "tests" / "data" / "parity" / "inputs"
TOLERANCE = 1e-5


def section() -> str:
    """docs/output.md from "Several models" to the next section."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(TITLE)
    end = text.find("\n## ", start + len(TITLE))
    return text[start:end if end > 0 else None]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section(), flags=re.S)


def run_cli(command: str) -> str:
    """One documented ``bulk-classify`` command, run by the CLI in this process (on the session's local Ray)."""
    from pipeline.cli import main

    args = shlex.split(command.replace("\\\n", " "))
    assert args[0] == "bulk-classify", command
    result = CliRunner().invoke(main, args[1:] + ["--quiet"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def duckdb_rows(sql: str) -> list[tuple]:
    import duckdb

    return duckdb.connect().execute(sql).fetchall()


def parquet_rows(folder: Path) -> dict[str, dict]:
    rows = pads.dataset(str(folder), format="parquet").to_table().to_pylist()
    return {r["uri"]: r for r in rows}


@pytest.fixture
def in_workdir(tmp_path):
    """The documented layout in a fresh folder, the working directory while the test runs: photos/ (the committed
    photos and one truncated JPEG) and models/brightness, models/brightness-v2, models/colour."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for photo in sorted(PHOTOS.glob("*.jpg")):
        shutil.copy(photo, photos / photo.name)
    (photos / "broken.jpg").write_bytes((PHOTOS / "coffee.jpg").read_bytes()[:300])
    # weights under which the two versions agree on 6 of the 10 photos, so the disagreement query has rows either way
    model_folder(tmp_path / "models" / "brightness", seed=2)
    model_folder(tmp_path / "models" / "brightness-v2", seed=5)
    embedding_folder(tmp_path / "models" / "colour")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(cwd)


def test_the_section_shows_the_commands_and_queries_this_test_runs():
    assert len(blocks("bash")) == 4 and len(blocks("sql")) == 6 and len(blocks("python")) == 1


def test_a_model_set_in_parquet_answers_the_documented_duckdb_queries(in_workdir, ray_local, onnx_engine):
    run_cli(blocks("bash")[0])

    rows = parquet_rows(in_workdir / "labels")
    assert len(rows) == 11
    schema = pads.dataset(str(in_workdir / "labels"), format="parquet").schema
    assert [n for n in schema.names if pa.types.is_struct(schema.field(n).type)] == [
        "taxonomy", "brightness", "brightness_v2"]
    assert not {"class_ids", "labels", "scores", "embedding"} & set(schema.names)
    ok = {u: r for u, r in rows.items() if r["status"] == "ok"}
    assert len(ok) == 10
    digests = {r["model_digest"] for r in rows.values()}
    assert {r["model"] for r in rows.values()} == {"taxonomy,brightness,brightness_v2"} and len(digests) == 1
    assert len({r[m]["model_digest"] for r in ok.values() for m in ("taxonomy", "brightness", "brightness_v2")}) == 3
    photos = sorted(PHOTOS.glob("*.jpg"))  # the taxonomy column is the built-in model's answer under ONNX Runtime
    by_name = {u.rsplit("/", 1)[-1]: r for u, r in ok.items()}
    for photo, result in zip(photos, onnx_engine.classify([p.read_bytes() for p in photos])):
        assert by_name[photo.name]["taxonomy"]["labels"] == result.labels
        np.testing.assert_allclose(by_name[photo.name]["taxonomy"]["scores"], result.scores, atol=1e-6)
    [broken] = [r for r in rows.values() if r["status"] == "error"]
    assert broken["error"].startswith("decode_error: ") and "model " not in broken["error"]
    assert all(broken[m] is None for m in ("taxonomy", "brightness", "brightness_v2"))

    top1, disagree, confident, failed = (duckdb_rows(sql) for sql in blocks("sql")[:4])

    assert top1 == [(u, r["taxonomy"]["labels"][0], pytest.approx(r["taxonomy"]["scores"][0]),
                     r["brightness"]["labels"][0], pytest.approx(r["brightness"]["scores"][0]))
                    for u, r in sorted(ok.items())]
    expected = [(u, r["brightness"]["labels"][0], r["brightness_v2"]["labels"][0]) for u, r in sorted(ok.items())
                if r["brightness"]["labels"][0] != r["brightness_v2"]["labels"][0]]
    assert disagree == expected and 0 < len(disagree) < len(ok)  # the two versions agree on some photos, not all
    expected = sorted(((u, r["taxonomy"]["labels"][0], r["taxonomy"]["scores"][0]) for u, r in ok.items()
                       if r["taxonomy"]["scores"][0] >= np.float32(0.3)), key=lambda t: (-t[2], t[0]))
    assert [(u, label, pytest.approx(score)) for u, label, score in expected] == confident
    assert 0 < len(confident) < len(ok)
    assert failed == [(broken["uri"], broken["error"])]


def test_a_model_set_in_iceberg_answers_the_documented_pyiceberg_scan_and_refuses_another_set(
        in_workdir, ray_local):
    from pipeline.errors import OutputError
    from pipeline.io.iceberg_output import IcebergOutput

    run_cli(blocks("bash")[0])  # the same set into a folder, for the rows the table must hold
    expected = {u: r["taxonomy"]["labels"][0] for u, r in parquet_rows(in_workdir / "labels").items()
                if r["status"] == "ok"}
    run_cli(blocks("bash")[1])

    namespace: dict = {}
    exec(compile(blocks("python")[0], str(DOC), "exec"), namespace)  # noqa: S102 - the documented query is the test
    assert namespace["top1"] == expected and len(expected) == 10
    assert namespace["rows"].column_names == ["uri", "taxonomy", "brightness"]

    table = IcebergOutput("iceberg://catalog.labels").table
    names = [f.name for f in table.schema().fields]
    assert names[:6] == ["uri", "status", "error", "taxonomy", "brightness", "brightness_v2"]
    assert table.scan().to_arrow().num_rows == 11

    from pipeline.cli import main

    other = CliRunner().invoke(main, ["run", "photos/", "--output", "iceberg://catalog.labels", "--model",
                                      "taxonomy=default", "--model", "brightness=models/brightness", "--quiet"])
    assert other.exit_code != 0
    message = other.output.strip().splitlines()
    assert len(message) == 1 and "Iceberg table catalog.labels has the columns" in message[0], other.output
    assert "brightness_v2{…}" in message[0] and "not this run's" in message[0]
    assert "choose another table for --output" in message[0]
    with pytest.raises(OutputError, match="not this run's"):
        IcebergOutput("iceberg://catalog.labels").expect(pq.read_schema(next((in_workdir / "labels").rglob(
            "part-*.parquet"))).remove(3))
    assert len(table.metadata.snapshots) == 1  # the refused run added nothing


def test_an_embedding_in_iceberg_is_a_list_of_float_with_the_same_values(tmp_path):
    from pipeline.io.iceberg_output import IcebergOutput
    from pipeline.columns import output_schema
    from pipeline.storage import open_fs

    schema = output_schema((("taxonomy", None), ("colour", DIM)))
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(4, DIM)).astype(np.float32)
    answer = {"class_ids": [1], "labels": ["x"], "scores": [0.5], "model": "m", "model_digest": "d" * 64}
    rows = [{"uri": f"file:///{i}.jpg", "status": "ok", "taxonomy": answer,
             "colour": {**answer, "embedding": vectors[i].tolist()}} for i in range(len(vectors))]
    output = IcebergOutput("iceberg://catalog.vectors", {"warehouse": str(tmp_path)}, schema=schema)
    fs, root = open_fs(output.data_folder)
    fs.makedirs(root, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), f"{root}/part-0.parquet")

    assert output.commit(fs, [f"{root}/part-0.parquet"], {"model": "taxonomy,colour"}) == 1

    table = IcebergOutput("iceberg://catalog.vectors", {"warehouse": str(tmp_path)}).table  # a reader's check
    back = table.scan().to_arrow()
    column = back.schema.field("colour").type.field("embedding").type
    assert pa.types.is_list(column) and column.value_type == pa.float32()
    assert np.array_equal(np.array([r["colour"]["embedding"] for r in back.to_pylist()], np.float32), vectors)
    IcebergOutput("iceberg://catalog.vectors", {"warehouse": str(tmp_path)}, schema=schema)  # the same set: taken


def test_an_embedding_column_ranks_neighbours_in_duckdb_as_numpy_and_equals_onnx_runtime(in_workdir, ray_local):
    import onnxruntime as ort

    from pipeline.model.folder import load_model_folder
    from pipeline.model.imaging import load_and_preprocess

    shutil.rmtree(in_workdir / "photos")
    shutil.copytree(PARITY, in_workdir / "photos")  # 200 real photos, so neighbours are many and close
    command = blocks("bash")[2]
    assert "--model colour=models/colour" in command
    run_cli(command)

    rows = {u: r for u, r in parquet_rows(in_workdir / "vectors").items() if r["status"] == "ok"}
    assert len(rows) == len(list(PARITY.glob("*.jpg"))) == 200
    uris = sorted(rows)
    stored = np.array([rows[u]["colour"]["embedding"] for u in uris], np.float32)
    assert stored.shape == (200, DIM)
    np.testing.assert_allclose(np.linalg.norm(stored, axis=1), 1.0, atol=TOLERANCE)

    bundle = load_model_folder(in_workdir / "models" / "colour")
    session = ort.InferenceSession(str(bundle.onnx_path), providers=["CPUExecutionProvider"])
    batch = np.stack([load_and_preprocess((in_workdir / "photos" / u.rsplit("/", 1)[-1]).read_bytes(),
                                          bundle.spec)[0] for u in uris])
    [raw] = session.run([EMBEDDING], {bundle.input_name: batch})
    np.testing.assert_allclose(stored, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=TOLERANCE, rtol=0)

    sql = blocks("sql")[4]
    assert f"FLOAT[{DIM}]" in sql
    found = duckdb_rows(sql)

    similarity = stored.astype(np.float64) @ stored.astype(np.float64).T
    np.fill_diagonal(similarity, -np.inf)
    nearest = similarity.argmax(axis=1)
    assert [u for u, _, _ in found] == uris
    np.testing.assert_allclose([s for _, _, s in found], similarity[np.arange(200), nearest], atol=TOLERANCE)
    ranked = np.sort(similarity, axis=1)
    clear = ranked[:, -1] - ranked[:, -2] > TOLERANCE  # where float32 rounding cannot swap the two best
    assert clear.sum() >= 190
    index = {u: i for i, u in enumerate(uris)}
    for i, (_, neighbour, _) in enumerate(found):
        if clear[i]:
            assert neighbour == uris[nearest[i]]
        else:  # a near tie: DuckDB's pick is one of the best within float32 rounding
            assert similarity[i, index[neighbour]] >= ranked[i, -1] - TOLERANCE


def test_a_model_run_alone_into_its_own_output_joins_the_set_on_uri_as_documented(in_workdir, ray_local):
    run_cli(blocks("bash")[0])
    run_cli(blocks("bash")[3])

    labels, colour = parquet_rows(in_workdir / "labels"), parquet_rows(in_workdir / "labels-colour")
    assert set(labels) == set(colour) and len(colour) == 11
    schema = pads.dataset(str(in_workdir / "labels-colour"), format="parquet").schema
    assert [n for n in schema.names if pa.types.is_struct(schema.field(n).type)] == ["colour"]
    assert {r["model"] for r in colour.values()} == {"colour"}
    ok = sorted(u for u in labels if labels[u]["status"] == "ok" and colour[u]["status"] == "ok")
    assert len(ok) == 10
    assert duckdb_rows(blocks("sql")[5]) == [
        (u, labels[u]["taxonomy"]["labels"][0], colour[u]["colour"]["labels"][0]) for u in ok]
    # the broken photo's row sits among ok rows: an error row's embedding (null) between others writes and reads back
    assert [u for u in colour if colour[u]["status"] == "error"] == [u for u in colour if u.endswith("/broken.jpg")]
    assert all(colour[u]["colour"] is None for u in colour if u not in ok)
    assert all(len(colour[u]["colour"][EMBEDDING_COLUMN]) == DIM for u in ok)


def test_one_models_embedding_with_an_error_row_writes_reads_back_and_carries_over(in_workdir, ray_local):
    run_cli("bulk-classify run photos/ --output one/ --model models/colour")
    run_cli("bulk-classify run photos/ --output two/ --model models/colour --previous one/")

    one, two = parquet_rows(in_workdir / "one"), parquet_rows(in_workdir / "two")
    assert set(one) == set(two) and len(one) == 11
    [broken] = [u for u in one if one[u]["status"] == "error"]
    assert broken.endswith("/broken.jpg") and one[broken][EMBEDDING_COLUMN] is None and two[broken][EMBEDDING_COLUMN] is None
    ok = [u for u in one if u != broken]
    assert all(len(one[u][EMBEDDING_COLUMN]) == DIM for u in ok)
    assert all(two[u]["carried"] and two[u][EMBEDDING_COLUMN] == one[u][EMBEDDING_COLUMN] for u in ok)
