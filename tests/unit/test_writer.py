"""Fast unit tests of pipeline.io.writer, pipeline.io.reader and pipeline.io.stats: shards, their records, the grouped layout (no Ray)."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from pipeline.columns import conform
from pipeline.io.keys import identity_hash, uri_hash
from pipeline.io.reader import committed_parts, iter_records, read_record
from pipeline.io.stats import ShardStats
from pipeline.io.writer import ShardRecord, part_name, shard_id, write_shard
from pipeline.schema import OUTPUT_SCHEMA, RECORD_KEY, WORK_SCHEMA
from pipeline.storage import open_fs

WHEN = datetime(2026, 11, 30, 3, 0, tzinfo=timezone.utc)


M_DIGEST = "d" * 64  # model "m"'s digest


def rows(n: int, start: int = 0, *, errors: int = 0, carried: int = 0) -> pa.Table:
    out = []
    for i in range(start, start + n):
        bad = i - start < errors
        out.append({
            "uri": f"file:///src/img{i:06d}.jpg", "status": "error" if bad else "ok",
            "error": "decode_error: broken" if bad else None, "class_ids": None if bad else [1, 2],
            "labels": None if bad else ["a", "b"], "scores": None if bad else [0.6, 0.4], "model": "m",
            "model_digest": M_DIGEST,
            "engine": "onnx", "size_bytes": 1000 + i, "etag": None, "mtime": WHEN, "classified_at": WHEN,
            "carried": i - start >= n - carried, "_fetch_s": 0.01, "_infer_s": 0.02, "_engine_calls": 0.5,
        })
    return conform(pa.Table.from_pylist(out, schema=WORK_SCHEMA), WORK_SCHEMA)


def test_shard_id_is_order_independent_and_parts_are_grouped():
    a = shard_id(["s3://b/1.jpg", "s3://b/2.jpg"])
    assert a == shard_id(["s3://b/2.jpg", "s3://b/1.jpg"]) != shard_id(["s3://b/1.jpg"])
    assert part_name(a) == f"{a[:2]}/part-{a}.parquet"


def test_write_shard_commits_rows_and_a_record_in_the_footer(tmp_path):
    batch = rows(10, errors=2, carried=3)
    stats = next(ShardStats.from_table(write_shard(batch, output=str(tmp_path), storage_options={})))
    assert (stats.rows, stats.ok, stats.errors, stats.carried, stats.classified) == (10, 8, 2, 3, 7)
    assert stats.error_kinds == {"decode_error": 2} and stats.decode_s is None
    assert stats.engine_calls == pytest.approx(5.0) and stats.infer_s == pytest.approx(0.2)
    fs, root = open_fs(str(tmp_path))
    [path] = committed_parts(fs, root)
    assert path.startswith(str(tmp_path / shard_id(batch.column("uri").to_pylist())[:2]))
    table = pq.read_table(path)
    assert table.schema.remove_metadata() == OUTPUT_SCHEMA and table.num_rows == 10
    rec = read_record(fs, path)
    assert (rec.rows, rec.ok, rec.errors, rec.carried, rec.model, rec.top_k) == (10, 8, 2, 3, "m", 2)
    # in row order (ok rows only for identities), so a carry task takes a row's hashes without hashing again
    assert rec.row_order and rec.uri_hashes.tolist() == [uri_hash(u) for u in batch.column("uri").to_pylist()]
    ok = [r for r in batch.to_pylist() if r["status"] == "ok"]
    expect = [identity_hash(r["uri"], None, r["size_bytes"], int(WHEN.timestamp() * 1_000_000)) for r in ok]
    assert rec.identities.tolist() == expect
    # a retried write of the same rows replaces the shard, never adds one
    write_shard(batch, output=str(tmp_path), storage_options={})
    assert committed_parts(fs, root) == [path]
    assert pads.dataset(str(tmp_path), format="parquet").count_rows() == 10  # readers see DEST as one dataset


def test_committed_parts_reads_flat_and_grouped_layouts_and_skips_everything_else(tmp_path):
    fs, root = open_fs(str(tmp_path))
    write_shard(rows(5), output=str(tmp_path), storage_options={})
    pq.write_table(conform(rows(4, 100), OUTPUT_SCHEMA), tmp_path / "part-old.parquet")  # a flat, older output
    (tmp_path / ".part-x.parquet.1.tmp").write_bytes(b"half")
    (tmp_path / "date=2026-11-29").mkdir()
    pq.write_table(conform(rows(3, 200), OUTPUT_SCHEMA), tmp_path / "date=2026-11-29" / "part-no.parquet")
    (tmp_path / "zz").mkdir()
    pq.write_table(conform(rows(3, 300), OUTPUT_SCHEMA), tmp_path / "zz" / "part-no.parquet")
    parts = committed_parts(fs, root)
    assert len(parts) == 2 and any(p.endswith("/part-old.parquet") for p in parts)
    # the old shard has no record: it is read and hashed instead
    records = dict(iter_records(fs, parts))
    old = records[next(p for p in parts if p.endswith("part-old.parquet"))]
    assert (old.rows, old.ok, old.model, old.top_k) == (4, 4, "m", 2)
    assert old.uri_hashes.size == 4 and old.identities.size == 4
    assert RECORD_KEY not in (pq.read_metadata(tmp_path / "part-old.parquet").metadata or {})


def test_record_round_trips_through_json():
    rec = ShardRecord(rows=3, ok=2, errors=1, carried=0, model="m", top_k=5,
                      uri_hashes=np.array([-5, 1, 9], np.int64), identities=np.array([2, 3], np.int64))
    back = ShardRecord.from_json(rec.to_json())
    assert back.uri_hashes.tolist() == [-5, 1, 9] and back.identities.tolist() == [2, 3] and back.top_k == 5


def test_carried_rows_take_their_hashes_from_a_row_order_record_or_are_hashed_from_an_older_one(tmp_path):
    from pipeline.job.stages import carry_rows
    from pipeline.io.reader import read_shard

    batch = rows(10, errors=2)
    write_shard(batch, output=str(tmp_path), storage_options={})
    fs, root = open_fs(str(tmp_path))
    [path] = committed_parts(fs, root)
    table, rec = read_shard(fs, path)
    assert table.schema == OUTPUT_SCHEMA and rec.row_order and rec.uri_hashes.size == 10
    carried = np.sort(rec.identities[::2])  # every other ok row is unchanged
    new = carry_rows(table, carried, rec)
    sorted_v1 = ShardRecord.from_json(ShardRecord(**{**rec.__dict__, "row_order": False}).to_json())
    assert not sorted_v1.row_order
    for rows_, keys, ids in (new, carry_rows(table, carried, sorted_v1), carry_rows(table, carried)):
        uris = rows_.column("uri").to_pylist()
        assert uris == [f"file:///src/img{i:06d}.jpg" for i in range(2, 10, 2)]
        assert keys.tolist() == [uri_hash(u) for u in uris] and sorted(ids.tolist()) == carried.tolist()
        assert rows_.column("carried").to_pylist() == [True] * 4
        assert ShardRecord.of_rows(rows_, uri_keys=keys, identities=ids).to_json() == ShardRecord.of_rows(rows_).to_json()


def test_shard_stats_sum_and_round_trip():
    a = ShardStats(rows=3, ok=2, errors=1, carried=1, error_kinds={"x": 1}, fetch_s=1.0, infer_s=2.0,
                   engine_calls=1.0)
    b = ShardStats(rows=2, ok=1, errors=1, error_kinds={"x": 1, "y": 0}, decode_s=0.5, write_s=0.1)
    total = ShardStats()
    for s in (a, b):
        total += s
    assert (total.rows, total.ok, total.errors, total.carried, total.classified) == (5, 3, 2, 1, 4)
    assert total.error_kinds == {"x": 2, "y": 0} and total.decode_s == 0.5 and total.fetch_s == 1.0
    assert list(ShardStats.from_table(a.to_table())) == [a]
    assert ShardStats().decode_s is None  # no engine told us: stays unknown, not zero
    assert total.report_fields()["counts"] == {"ok": 3, "error": 2}
    assert total.stage_seconds(0.5)["decode_preprocess"] == 0.5


def test_quality_counters_in_footers_add_up_to_the_quality_of_the_rows(tmp_path):
    from pipeline.quality.statistics import QualityStats, quality_footer, quality_of_parts

    batches = [rows(10, errors=2, carried=3), rows(7, 100, errors=1)]
    for b in batches:
        write_shard(b, output=str(tmp_path), storage_options={}, footer=quality_footer)
    flat = conform(rows(4, 200), OUTPUT_SCHEMA)
    pq.write_table(flat, tmp_path / "part-flat.parquet")  # no counters in its footer: read from its rows
    fs, root = open_fs(str(tmp_path))
    expect = QualityStats()
    for table in (*batches, flat):
        expect.add_table(conform(table, OUTPUT_SCHEMA))
    assert quality_of_parts(fs, committed_parts(fs, root)) == expect.to_dict()
    assert QualityStats.from_state(expect.to_state()).to_dict() == expect.to_dict()
