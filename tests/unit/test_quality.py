"""Quality statistics and the drift gate on hand-made Parquet outputs: numbers, thresholds, CLI exit codes, page."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.errors import ConfigError, OutputError
from pipeline.quality.statistics import (
    DRIFT_EXIT_CODE, DriftThresholds, QualityStats, compare_outputs, compare_quality, js_divergence,
    population_stability_index, quality_of_parts,
)
from pipeline.schema import OUTPUT_SCHEMA


def row(uri: str, label: str | None, top1: float = 0.9, second: float = 0.05, *, error: str | None = None,
        carried: bool = False) -> dict:
    if error:
        return {"uri": uri, "status": "error", "error": error, "labels": [], "scores": [], "class_ids": [],
                "carried": False}
    return {"uri": uri, "status": "ok", "labels": [label, "other"], "scores": [top1, second], "class_ids": [1, 2],
            "carried": carried}


def table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pydict({f.name: [r.get(f.name) for r in rows] for f in OUTPUT_SCHEMA}, schema=OUTPUT_SCHEMA)


RUN = {"counts": {"ok": 90, "error": 2}, "images": 92, "elapsed_s": 4.0, "engine_calls": 3, "engine": "onnx",
       "stage_seconds": {"list": 0.1, "fetch": 0.5, "decode_preprocess": 1.0, "infer": 2.5, "write": 0.2}}


def write_output(path, shards: list[list[dict]], success: bool = True) -> None:
    from pipeline.quality.report import build_run_report

    path.mkdir(parents=True, exist_ok=True)
    (path / "_REPORT.json").write_text(json.dumps(build_run_report(RUN)))
    for i, rows in enumerate(shards):
        pq.write_table(table(rows), path / f"part-{i:04d}.parquet")
    if success:
        (path / "_SUCCESS").write_text(json.dumps({"rows": sum(map(len, shards))}))


NIGHT = [row(f"a{i}", "tabby" if i % 2 else "golden retriever", 0.62 + 0.01 * (i % 30)) for i in range(60)] + \
        [row(f"b{i}", "space shuttle", 0.97, 0.01, carried=True) for i in range(30)] + \
        [row("e1", None, error="decode_error: truncated"), row("e2", None, error="not_found: gone")]


def test_stats_count_bins_labels_margin_floor_errors_and_mark_carried_rows():
    q = QualityStats().add_table(table(NIGHT + [row("low", "tabby", 0.2, 0.19)])).to_dict()
    assert q["rows"] == 93 and q["ok"] == 91 and q["errors"] == 2 and q["carried"] == 30
    assert len(q["confidence"]["edges"]) == 21 and sum(q["confidence"]["counts"]) == 91
    assert q["confidence"]["counts"][19] == 30  # 0.97 lands in [0.95, 1.0]
    assert q["confidence"]["carried_counts"] == [0] * 19 + [30]
    assert q["confidence"]["counts"][4] == 1  # 0.2 in [0.2, 0.25)
    assert q["below_floor"] == {"floor": 0.3, "rows": 1, "share": round(1 / 91, 6)}
    assert q["margin"]["counts"][0] == 1  # 0.2 - 0.19
    assert q["labels"] == {"tabby": 31, "golden retriever": 30, "space shuttle": 30}
    assert q["error_kinds"] == {"decode_error": 1, "not_found": 1}
    assert q["error_rates"] == {"decode_error": round(1 / 93, 6), "not_found": round(1 / 93, 6)}


def test_stats_shard_by_shard_equal_stats_of_the_whole(tmp_path):
    import fsspec

    write_output(tmp_path, [NIGHT[:17], NIGHT[17:50], NIGHT[50:]])
    fs = fsspec.filesystem("file")
    by_shard = quality_of_parts(fs, sorted(str(p) for p in tmp_path.glob("part-*.parquet")))
    assert by_shard == QualityStats().add_table(table(NIGHT)).to_dict()


def test_psi_and_js_reference_values():
    assert population_stability_index([10, 20, 30], [10, 20, 30]) == 0
    assert population_stability_index([1, 2, 3], [10, 20, 30]) == 0  # shares, not counts
    # hand computed: shares (0.5, 0.5) -> (0.25, 0.75): 0.25 ln 0.5 ... summed
    want = (0.25 - 0.5) * math.log(0.25 / 0.5) + (0.75 - 0.5) * math.log(0.75 / 0.5)
    assert population_stability_index([5, 5], [1, 3]) == pytest.approx(want, abs=1e-6)
    assert js_divergence({"a": 3, "b": 1}, {"a": 3, "b": 1}) == 0
    assert js_divergence({"a": 5}, {"b": 7}) == pytest.approx(1.0)  # disjoint: one bit
    kl = (lambda x, m: sum(a * math.log2(a / b) for a, b in zip(x, m)))
    want = (kl((0.9, 0.1), (0.85, 0.15)) + kl((0.8, 0.2), (0.85, 0.15))) / 2  # = 0.01438
    assert js_divergence({"a": 9, "b": 1}, {"a": 8, "b": 2}) == pytest.approx(want, abs=1e-6)


def test_compare_passes_on_the_same_night_and_names_each_crossing():
    q = QualityStats().add_table(table(NIGHT)).to_dict()
    same = compare_quality(q, q)
    assert same["psi"] == 0 and same["js_divergence"] == 0 and same["passed"] and same["breaches"] == []

    shifted = [row(f"a{i}", "tabby", 0.12 + 0.005 * (i % 30)) for i in range(60)] + NIGHT[60:] + \
              [row(f"n{i}", None, error="decode_error: bad") for i in range(6)]
    r = compare_quality(QualityStats().add_table(table(shifted)).to_dict(), q)
    assert not r["passed"]
    assert {b["metric"] for b in r["breaches"]} == {"psi", "js_divergence", "error_rate.decode_error"}
    top = r["label_shifts"][0]
    assert top["label"] == "golden retriever" and top["previous"] == 30 and top["current"] == 0
    assert r["error_rates"]["decode_error"]["current_rows"] == 7
    assert r["confidence_mean"]["change"] < 0
    # raised thresholds let the same night through
    loose = DriftThresholds(psi_max=100, js_max=1, error_rate_max_increase=1)
    assert compare_quality(QualityStats().add_table(table(shifted)).to_dict(), q, loose)["passed"]
    # too few rows: reported, not gated
    few = compare_quality(QualityStats().add_table(table(shifted[:5])).to_dict(), q)
    assert few["breaches"] and few["too_few_rows"] and few["passed"]


def test_thresholds_are_validated_with_the_fix():
    with pytest.raises(ConfigError, match=r"psi_max=-1 must be a number >= 0, e.g. --psi-max 0.1"):
        DriftThresholds(psi_max=-1)
    with pytest.raises(ConfigError, match="min_rows"):
        DriftThresholds(min_rows=-3)


def test_compare_outputs_uses_the_recorded_previous_and_errors_say_what_to_do(tmp_path):
    write_output(tmp_path / "d1", [NIGHT])
    write_output(tmp_path / "d2", [NIGHT[:40], NIGHT[40:]])
    with pytest.raises(OutputError, match="has no comparison recorded in its _REPORT.json"):
        compare_outputs(str(tmp_path / "d2"), "previous")
    (tmp_path / "d2" / "_REPORT.json").write_text(json.dumps({"drift": {"against": str(tmp_path / "d1")}}))
    r = compare_outputs(str(tmp_path / "d2"), "previous")
    assert r["against"] == str(tmp_path / "d1") and r["passed"] and r["psi"] == 0
    (tmp_path / "d2" / "_REPORT.json").write_text(json.dumps({"drift": None}))
    assert compare_outputs(str(tmp_path / "d2"), "previous")["against"] is None
    with pytest.raises(OutputError, match="holds no part-\\*.parquet shard"):
        compare_outputs(str(tmp_path / "d2"), str(tmp_path / "missing"))


def test_cli_report_against_exit_codes_json_and_page(tmp_path):
    write_output(tmp_path / "d1", [NIGHT])
    write_output(tmp_path / "same", [NIGHT])
    rotated = [row(f"a{i}", "jigsaw puzzle", 0.15) for i in range(60)] + NIGHT[60:]
    write_output(tmp_path / "d2", [rotated])
    runner = CliRunner()

    ok = runner.invoke(main, ["report", str(tmp_path / "same"), "--against", str(tmp_path / "d1")])
    assert ok.exit_code == 0, ok.output
    assert "gate: passed" in ok.output and "confidence PSI" in ok.output

    page = tmp_path / "page.html"
    bad = runner.invoke(main, ["report", str(tmp_path / "d2"), "--against", str(tmp_path / "d1"), "--json",
                               "--html", str(page)])
    assert bad.exit_code == DRIFT_EXIT_CODE == 3, bad.output
    got = json.loads(bad.output)
    assert not got["passed"] and got["psi"] > 0.25 and got["js_divergence"] > 0.05
    text = page.read_text()
    for chart in ("confidence", "margin", "label-shifts", "errors", "run"):
        assert f"data-chart='{chart}'" in text
    assert "<script" not in text and "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    assert "jigsaw puzzle" in text and "Gate FAILED" in text

    table_out = runner.invoke(main, ["report", str(tmp_path / "d2"), "--against", str(tmp_path / "d1")])
    assert table_out.exit_code == 3 and "DRIFT: top-1 confidence histogram moved" in table_out.output
    # thresholds from options
    loose = runner.invoke(main, ["report", str(tmp_path / "d2"), "--against", str(tmp_path / "d1"),
                                 "--psi-max", "50", "--js-max", "1"])
    assert loose.exit_code == 0, loose.output
    usage = runner.invoke(main, ["report", str(tmp_path / "d2"), "--against", str(tmp_path / "d1"),
                                 "--psi-max", "-1"])
    assert usage.exit_code == 2 and "--psi-max 0.1" in usage.output
    assert runner.invoke(main, ["report", str(tmp_path / "d2"), "--html", str(page)]).exit_code == 2
    missing = runner.invoke(main, ["report", str(tmp_path / "d2"), "--against", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "holds no part-*.parquet shard" in missing.output
    summary = runner.invoke(main, ["report", str(tmp_path / "d2"), "--json"])
    assert summary.exit_code == 0 and json.loads(summary.output)["rows"] == len(rotated)
    assert "Exit status with --against: 0 no threshold crossed, 3 drift" in runner.invoke(
        main, ["report", "--help"]).output


def test_recorded_quality_is_used_only_when_it_covers_every_row(tmp_path):
    from pipeline.quality.statistics import output_quality

    write_output(tmp_path / "d", [NIGHT])
    real = QualityStats().add_table(table(NIGHT)).to_dict()
    fake = {**real, "labels": {"recorded": 1}}
    (tmp_path / "d" / "_REPORT.json").write_text(json.dumps({"quality": fake}))
    assert output_quality(str(tmp_path / "d"))[0]["labels"] == {"recorded": 1}
    (tmp_path / "d" / "_REPORT.json").write_text(json.dumps({"quality": {**fake, "rows": 5}}))
    assert output_quality(str(tmp_path / "d"))[0] == real
