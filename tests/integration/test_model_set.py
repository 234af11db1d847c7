"""A model set in one pass through the real job (local Ray, the onnx engine): each model's column equals that model's
own run, one row per input, the set's identity in resume and carry-over, and every bad set refused before anything is
written."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from pipeline.config import RunConfig
from pipeline.errors import ConfigError, ModelError, OutputError
from pipeline.job import run_job
from pipeline.model.model_set import named_models
from pipeline.schema import OUTPUT_SCHEMA
from support.odd_models import bright_images, model_folder

REPO = Path(__file__).resolve().parents[2]
PHOTOS = REPO / "tests" / "data" / "parity" / "inputs"


def rows(out: Path) -> dict[str, dict]:
    table = pads.dataset(str(out), format="parquet").to_table()
    listed = table.to_pylist()
    assert len(listed) == len({r["uri"] for r in listed})  # one row per input
    return {Path(r["uri"]).name: r for r in listed}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A folder of real photos with a non-image and one bright image (the nonfinite model's NaN), a small user model
    and the nonfinite one."""
    root = tmp_path_factory.mktemp("model_set")
    src = root / "src"
    src.mkdir()
    for photo in sorted(PHOTOS.glob("*.jpg"))[:24]:
        shutil.copy(photo, src / photo.name)
    (src / "notes.jpg").write_bytes(b"this is not an image")
    (src / "white.png").write_bytes(bright_images()["white.png"])
    return src, model_folder(root / "colour", seed=3), model_folder(root / "fragile", "nonfinite", seed=4)


@pytest.fixture(scope="module")
def runs(sources, tmp_path_factory, ray_local) -> dict[str, Path]:
    src, colour, _fragile = sources
    root = tmp_path_factory.mktemp("runs")
    outs = {"set": root / "set", "taxonomy": root / "taxonomy", "colour": root / "colour"}
    run_job(RunConfig(source=str(src), output=str(outs["set"]), model=("taxonomy=default", f"colour={colour}"),
                      engine="onnx", top_k=3))
    run_job(RunConfig(source=str(src), output=str(outs["taxonomy"]), engine="onnx", top_k=3))
    run_job(RunConfig(source=str(src), output=str(outs["colour"]), model=str(colour), engine="onnx", top_k=3))
    return outs


def test_each_models_column_is_that_models_own_run(runs, sources):
    together, alone = rows(runs["set"]), {name: rows(runs[name]) for name in ("taxonomy", "colour")}
    assert set(together) == set(alone["taxonomy"]) == set(alone["colour"])  # 26 inputs, 26 rows each
    assert len(together) == 26
    for name, row in together.items():
        assert row["status"] == alone["taxonomy"][name]["status"], name
        assert row["error"] == alone["taxonomy"][name]["error"], name
        for model in ("taxonomy", "colour"):
            own = alone[model][name]
            if own["status"] != "ok":
                assert row[model] is None
                continue
            assert row[model]["class_ids"] == own["class_ids"], (name, model)
            assert row[model]["labels"] == own["labels"]
            assert row[model]["scores"] == pytest.approx(own["scores"], abs=1e-6)
            assert row[model]["model_digest"] == own["model_digest"]
    assert together["notes.jpg"]["status"] == "error" and together["notes.jpg"]["taxonomy"] is None


def test_the_set_writes_its_own_schema_and_identity(runs):
    table = pads.dataset(str(runs["set"]), format="parquet").to_table()
    names = table.schema.names
    assert names[:5] == ["uri", "status", "error", "taxonomy", "colour"]
    assert not {"class_ids", "labels", "scores"} & set(names)
    assert table.schema.field("taxonomy").type.names == ["class_ids", "labels", "scores", "model", "model_digest"]
    assert set(table.column("model").to_pylist()) == {"taxonomy,colour"}
    # one unnamed model: today's schema, unchanged
    alone = pads.dataset(str(runs["taxonomy"]), format="parquet").schema
    assert alone.remove_metadata() == OUTPUT_SCHEMA


def test_a_rerun_resumes_and_another_set_is_refused(runs, sources, ray_local):
    src, colour, _ = sources
    again = run_job(RunConfig(source=str(src), output=str(runs["set"]), engine="onnx", top_k=3,
                              model=("colour=" + str(colour), "taxonomy=default")))  # the same set, other order
    assert (again.classified, again.already_done) == (0, 26)
    with pytest.raises(OutputError, match="holds rows of model 'colour,taxonomy'"):
        run_job(RunConfig(source=str(src), output=str(runs["set"]), engine="onnx", top_k=3,
                          model=("taxonomy=default",)))


def test_a_previous_run_of_the_same_set_is_carried(runs, sources, tmp_path, ray_local):
    src, colour, _ = sources
    out = tmp_path / "next"
    summary = run_job(RunConfig(source=str(src), output=str(out), previous=str(runs["set"]), engine="onnx",
                                top_k=3, model=("taxonomy=default", f"colour={colour}")))
    ok = sum(r["status"] == "ok" for r in rows(runs["set"]).values())
    assert (summary.carried, summary.classified) == (ok, 26 - ok)
    carried = rows(out)
    for name, row in rows(runs["set"]).items():
        if row["status"] == "ok":
            assert carried[name]["taxonomy"] == row["taxonomy"] and carried[name]["carried"]


def test_a_previous_run_of_one_model_carries_nothing_into_a_set_and_says_why(runs, sources, tmp_path, ray_local,
                                                                              caplog):
    src, colour, _ = sources
    ok = sum(r["status"] == "ok" for r in rows(runs["taxonomy"]).values())
    with caplog.at_level("WARNING", logger="pipeline.job.output"):
        summary = run_job(RunConfig(source=str(src), output=str(tmp_path / "added"), previous=str(runs["taxonomy"]),
                                    engine="onnx", top_k=3, model=("taxonomy=default", f"colour={colour}")))
    assert (summary.carried, summary.classified) == (0, 26)
    [note] = [r.getMessage() for r in caplog.records if "not carried over" in r.getMessage()]
    assert f": {ok} ok row(s) are not carried over: they were written by model 'efficientnet-lite0'" in note
    assert "this run by model 'taxonomy,colour'" in note and "join on uri (docs/output.md)" in note


def test_one_models_failure_is_its_error_and_the_other_model_still_answers(sources, tmp_path, ray_local):
    src, _colour, fragile = sources
    out = tmp_path / "fragile"
    run_job(RunConfig(source=str(src), output=str(out), engine="onnx", model=("taxonomy=default",
                                                                              f"fragile={fragile}")))
    white = rows(out)["white.png"]
    assert white["status"] == "error"
    assert white["error"].startswith("engine_error: model fragile: engine_error: the network's output")
    assert white["fragile"] is None
    assert white["taxonomy"]["labels"]  # the built-in model answered


@pytest.mark.parametrize("models, message", [
    (("a=default", "a=default"), "--model a= is given twice"),
    (("a=default", "Bad-Name=default"), "'Bad-Name' is not a column name"),
    (("status=default", "b=default"), "'status' is one of the output's own columns"),
    (("a=default", "default"), "has no name beside other models"),
    (("a=",), "--model a= names no model"),
])
def test_a_bad_set_is_refused_in_one_line(models, message, tmp_path):
    with pytest.raises(ConfigError, match=message) as err:
        RunConfig(source=str(PHOTOS), output=str(tmp_path / "out"), model=models)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_missing_model_of_a_set_is_refused_before_the_output_is_touched(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ModelError, match="does not exist"):
        run_job(RunConfig(source=str(PHOTOS), output=str(out), engine="onnx",
                          model=("a=default", f"b={tmp_path / 'nowhere'}")))
    assert not out.exists()


def test_the_cli_refuses_a_name_given_twice_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(PHOTOS), "--output", str(tmp_path / "o"),
                             "--model", "a=default", "--model", "a=default"], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["Error: --model a= is given twice; each model of a set needs a name "
                                                  "of its own"]
    assert not (tmp_path / "o").exists()


def test_the_struct_schema_round_trips_through_the_reader(runs):
    import fsspec

    from pipeline.io.reader import read_shard

    part = next(runs["set"].rglob("part-*.parquet"))
    table, record = read_shard(fsspec.filesystem("file"), str(part))
    assert "taxonomy" in table.schema.names and pa.types.is_struct(table.schema.field("colour").type)
    assert record is not None and record.model == "taxonomy,colour" and record.top_k == 3


def test_the_report_and_the_drift_gate_are_per_model(runs):
    import copy
    import json

    from pipeline.quality.statistics import DriftThresholds, compare_quality

    quality = json.loads((runs["set"] / "_REPORT.json").read_text())["quality"]
    ok = {name: sum(r[name] is not None for r in rows(runs["set"]).values()) for name in ("taxonomy", "colour")}
    assert {name: quality["models"][name]["ok"] for name in ok} == ok
    own = json.loads((runs["colour"] / "_REPORT.json").read_text())["quality"]
    assert quality["models"]["colour"]["labels"] == own["labels"]  # the same counts as the model's own run
    shifted = copy.deepcopy(quality)
    labels = shifted["models"]["colour"]["labels"]
    labels["product_9"] = sum(labels.values())  # the colour model now answers a new class for half the rows
    result = compare_quality(shifted, quality, DriftThresholds(min_rows=0))
    assert not result["passed"]
    assert [b["metric"] for b in result["breaches"]] == ["colour.js_divergence"]
    assert result["breaches"][0]["message"].startswith("model colour: top-1 label distribution moved")
    assert compare_quality(quality, quality, DriftThresholds(min_rows=0))["passed"]


def test_the_classifier_takes_a_set_and_answers_like_each_model_alone(sources):
    from pipeline.api import Classifier

    _src, colour, _ = sources
    images = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))[:6]] + [b"junk"]
    batch = pa.table({"bytes": images})
    together = Classifier(model=["taxonomy=default", f"colour={colour}"], engine="onnx", top_k=3)(batch)
    assert together.schema.names == ["bytes", "status", "error", "taxonomy", "colour", "width", "height", "model",
                                     "model_digest", "engine"]
    for name, alone in (("taxonomy", Classifier(engine="onnx", top_k=3)(batch)),
                        ("colour", Classifier(model=str(colour), engine="onnx", top_k=3)(batch))):
        for row, own in zip(together.to_pylist(), alone.to_pylist()):
            assert row["status"] == own["status"] and row["error"] == own["error"]
            if own["status"] == "ok":
                assert row[name]["class_ids"] == own["class_ids"]
                assert row[name]["scores"] == pytest.approx(own["scores"], abs=1e-6)
            else:
                assert row[name] is None


def test_openvino_runs_a_set_on_one_decode_like_each_model_alone(sources, default_bundle):
    pytest.importorskip("openvino")
    from pipeline.engines.openvino import OpenVinoEngine
    from pipeline.model.folder import load_model

    _src, colour, _ = sources
    other = load_model(str(colour))
    images = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))[:8]] + [b"junk"]
    with OpenVinoEngine(default_bundle, top_k=3, more=(other,)) as pair, \
            OpenVinoEngine(default_bundle, top_k=3) as first, OpenVinoEngine(other, top_k=3) as second:
        together, alone, other_alone = pair.classify(images), first.classify(images), second.classify(images)
    for row, a, b in zip(together, alone, other_alone):
        assert (row.status, row.error) == (a.status, a.error)
        assert [r.class_ids for r in [row, *row.more]] == [a.class_ids, b.class_ids][:1 + len(row.more)]
        assert len(row.more) == (1 if a.status == "ok" else 0)


def test_the_nightlys_file_takes_a_set(tmp_path, sources):
    from pipeline.nightly import collect_options

    _src, colour, _ = sources
    config_file = tmp_path / "nightly.yaml"
    config_file.write_text(f"model:\n  - taxonomy=default\n  - colour={colour}\ntop_k: 3\n", encoding="utf-8")
    options = collect_options(str(config_file), {})
    config = RunConfig.build({**options, "source": str(PHOTOS), "output": str(tmp_path / "out")}, env={})
    assert named_models(config.model) == (("taxonomy", "default"), ("colour", str(colour)))


def test_the_summary_counts_each_models_top_labels_as_its_own_run_does(runs):
    from pipeline.quality.report import format_summary, summarize_output

    summary = summarize_output(str(runs["set"]))
    for name in ("taxonomy", "colour"):
        assert summary["model_top_labels"][name] == summarize_output(str(runs[name]))["top_labels"]
    assert "top-1 of colour" in format_summary(summary)
    assert "model_top_labels" not in summarize_output(str(runs["taxonomy"]))  # one model: the summary as before
