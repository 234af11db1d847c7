"""Run reports and output summaries: numbers from real Parquet shards, on disk and on a real S3 endpoint."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import ConfigError, OutputError
from pipeline.quality.report import build_run_report, format_run_report, format_summary, summarize_output
from pipeline.schema import OUTPUT_SCHEMA

STATS = {
    "counts": {"ok": 90, "error": 10},
    "error_kinds": {"not_found": 4, "decode_error": 6},
    "images": 100,
    "classified": 80,
    "carried": 20,
    "already_done": 5,
    "elapsed_s": 4.0,
    "stage_seconds": {"list": 0.1, "fetch": 1.0, "decode_preprocess": None, "infer": 5.0, "write": 0.4},
    "engine_calls": 5.0,
    "model": "efficientnet_lite0",
    "engine": "onnx",
    "started_at": "2026-11-29T02:00:00+00:00",
    "finished_at": "2026-11-29T02:00:04+00:00",
}


def test_run_report_derives_rates_batch_size_and_stage_shares():
    r = build_run_report(STATS)
    assert r["images_per_s"] == 20.0  # 80 classified / 4 s
    assert r["rows_per_s"] == 25.0
    assert r["avg_batch_size"] == 16.0  # 80 / 5 calls
    assert r["engine_calls"] == 5
    assert r["counts"] == {"error": 10, "ok": 90}
    assert list(r["error_kinds"]) == ["decode_error", "not_found"]  # most frequent first
    assert r["stage_seconds"]["decode_preprocess"] is None
    assert r["stage_share"]["infer"] == pytest.approx(5.0 / 6.5, abs=1e-4)
    assert r["stage_share"]["decode_preprocess"] is None
    assert json.loads(json.dumps(r)) == r  # JSON-safe


def test_run_report_edge_cases_and_bad_input():
    empty = build_run_report({"counts": {}, "elapsed_s": 0.0, "stage_seconds": {}, "engine_calls": 0})
    assert empty["images"] == 0 and empty["images_per_s"] is None and empty["avg_batch_size"] is None
    with pytest.raises(ConfigError, match="unknown stage"):
        build_run_report({**STATS, "stage_seconds": {"decode": 1.0}})
    with pytest.raises(ConfigError, match="elapsed_s"):
        build_run_report({**STATS, "elapsed_s": -1})
    with pytest.raises(ConfigError, match="counts"):
        build_run_report({**STATS, "counts": {"ok": 1.5}})


def test_format_run_report_is_a_short_table():
    text = format_run_report(build_run_report(STATS))
    lines = text.splitlines()
    assert len(lines) <= 14
    assert "efficientnet_lite0" in lines[0] and "onnx" in lines[0]
    assert any(line.startswith("img/s") and "20.00" in line for line in lines)
    assert any(line.startswith("avg batch") and "16.00" in line for line in lines)
    assert any("decode_error 6, not_found 4" in line for line in lines)
    for stage in ("list", "fetch", "decode_preprocess", "infer", "write"):
        assert any(line.split() and line.split()[0] == stage for line in lines), stage


def shard(rows: list[dict]) -> pa.Table:
    cols = {f.name: [r.get(f.name) for r in rows] for f in OUTPUT_SCHEMA}
    return pa.Table.from_pydict(cols, schema=OUTPUT_SCHEMA)


def ok(uri: str, label: str, model: str = "efficientnet_lite0") -> dict:
    return {"uri": uri, "status": "ok", "labels": [label, "other"], "class_ids": [1, 2], "scores": [0.9, 0.1],
            "model": model}


def err(uri: str, error: str) -> dict:
    return {"uri": uri, "status": "error", "error": error, "labels": [], "class_ids": [], "scores": [],
            "model": "efficientnet_lite0"}


SHARDS = [
    [ok("a1", "tabby"), ok("a2", "tabby"), ok("a3", "golden retriever"), err("a4", "decode_error: truncated")],
    [ok("b1", "tabby"), err("b2", "not_found: gone"), err("b3", "decode_error: bad huffman table"),
     ok("b4", "space shuttle", model="resnet50")],
]


def write_output(fs_write, base: str, complete: bool) -> None:
    import io

    for i, rows in enumerate(SHARDS):
        buf = io.BytesIO()
        pq.write_table(shard(rows), buf)
        fs_write(f"{base}/part-{i:04d}.parquet", buf.getvalue())
    fs_write(f"{base}/_REPORT.json", json.dumps(build_run_report(STATS)).encode())
    if complete:
        fs_write(f"{base}/_SUCCESS", json.dumps({"finished_at": "2026-11-29T02:00:04+00:00"}).encode())


def check_summary(s: dict) -> None:
    assert s["rows"] == 8 and s["shards"] == 2
    assert s["counts"] == {"error": 3, "ok": 5}
    assert s["error_kinds"] == {"decode_error": 2, "not_found": 1}
    assert s["top_labels"][0] == {"label": "tabby", "count": 3, "share": 0.375}
    assert {t["label"] for t in s["top_labels"]} == {"tabby", "golden retriever", "space shuttle"}
    assert s["models"] == {"efficientnet_lite0": 7, "resnet50": 1}


def test_summarize_local_output(tmp_path):
    def put(path, data):
        (tmp_path / path.rsplit("/", 1)[-1]).write_bytes(data)

    write_output(put, str(tmp_path), complete=True)
    (tmp_path / ".part-0009.parquet.tmp").write_bytes(b"half written")  # ignored: not committed
    s = summarize_output(str(tmp_path))
    check_summary(s)
    assert s["complete"] and s["finished_at"] == "2026-11-29T02:00:04+00:00"
    assert s["last_run"]["images_per_s"] == 20.0
    text = format_summary(s)
    assert ": complete" in text and "tabby" in text and "decode_error" in text and "resnet50 (1)" in text


def test_summarize_output_on_s3(s3, s3_server):
    s3.create_bucket(Bucket="report-bucket")

    def put(path, data):
        s3.put_object(Bucket="report-bucket", Key=path.split("/", 1)[1], Body=data)

    write_output(put, "report-bucket/run1", complete=False)
    s = summarize_output("s3://report-bucket/run1")
    check_summary(s)
    assert not s["complete"]
    assert "INCOMPLETE" in format_summary(s)


def test_summarize_output_without_shards_says_what_to_do(tmp_path):
    with pytest.raises(OutputError, match="holds no part-\\*.parquet shard; point 'report' at a run's --output"):
        summarize_output(str(tmp_path))
    with pytest.raises(OutputError, match="holds no part"):
        summarize_output(str(tmp_path / "missing"))
    # a nightly output root: name the date folders to pick from
    for day in ("date=2026-11-27", "date=2026-11-28"):
        (tmp_path / day).mkdir()
        pq.write_table(shard([ok("x", "tabby")]), tmp_path / day / "part-0.parquet")
    with pytest.raises(OutputError, match=r"holds run folders: date=2026-11-27, date=2026-11-28; give one of them"):
        summarize_output(str(tmp_path))


def test_cli_report_prints_the_summary(tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main

    def put(path, data):
        (tmp_path / path.rsplit("/", 1)[-1]).write_bytes(data)

    write_output(put, str(tmp_path), complete=True)
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert ": complete" in result.output and "tabby" in result.output and "decode_error" in result.output
    result = CliRunner().invoke(main, ["report", str(tmp_path / "nothing")])
    assert result.exit_code != 0 and "holds no part-*.parquet shard" in result.output


def test_the_report_shows_the_engines_server_events(tmp_path):
    """_REPORT.json's engine_events (server starts, restarts, failovers, answers checked) in the run report's table
    and in `bulk-classify report`."""
    from click.testing import CliRunner

    from pipeline.cli import main

    def put(path, data):
        (tmp_path / path.rsplit("/", 1)[-1]).write_bytes(data)

    write_output(put, str(tmp_path), complete=True)
    events = {"server_starts": 1, "server_restarts": 2, "server_failovers": 0, "answers_checked": 80}
    report = build_run_report({**STATS, "engine": "triton", "engine_events": events})
    assert report["engine_events"] == dict(sorted(events.items()))
    line = "engine events       answers checked 80  server failovers 0  server restarts 2  server starts 1"
    assert line in format_run_report(report).splitlines()
    (tmp_path / "_REPORT.json").write_text(json.dumps(report))
    assert summarize_output(str(tmp_path))["last_run"]["engine_events"] == report["engine_events"]
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 0 and line in result.output.splitlines(), result.output
    with pytest.raises(ConfigError, match="engine_events"):
        build_run_report({**STATS, "engine_events": {"server_starts": -1}})
