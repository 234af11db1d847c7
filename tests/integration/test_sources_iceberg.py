"""Manifests as sources and an Iceberg table as the output, against moto's S3 and pyiceberg's SQLite catalog; a LIST
that fails mid-listing and links reached from two listing tasks."""

from __future__ import annotations

import glob
import gzip
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import quote_plus

import pytest

import pipeline.io.source as source
from conftest import free_port, make_jpeg
from pipeline.config import DEFAULT_EXTENSIONS, RunConfig
from pipeline.io.iceberg_output import IcebergOutput
from pipeline.io.source import list_unit, plan_listing
from pipeline.job import run_job
from pipeline.job.lease import Lease, LeaseHeld
from pipeline.storage import open_fs

LIVE = [f"photos/{i:02d}.jpg" for i in range(10)] + ["photos/b c.jpg"]
VANISHED = "photos/vanished.jpg"  # in the inventory, deleted from the bucket since


def inventory_line(key: str, version: str = "v1", latest: bool = True, deleted: bool = False) -> str:
    return (f'"inv-src","{quote_plus(key, safe="/")}","{version}","{str(latest).lower()}","{str(deleted).lower()}",'
            f'"600","2026-12-01T05:10:44.000Z","etag-{version}"')


@pytest.fixture(scope="module")
def inventory(s3):
    """An S3 Inventory report (CSV.gz) of bucket inv-src in two data files, and a third that is not gzip."""
    for bucket in ("inv-src", "inv-dest"):
        s3.create_bucket(Bucket=bucket)
    for i, key in enumerate(LIVE):
        s3.put_object(Bucket="inv-src", Key=key, Body=make_jpeg(700 + i))
    lines = [inventory_line(k) for k in LIVE] + [
        inventory_line("photos/00.jpg", "v0", latest=False),  # an older version of a live object
        inventory_line("photos/deleted.jpg", "v9", deleted=True),  # a delete marker
        inventory_line(VANISHED), inventory_line("photos/readme.txt")]
    files = []
    for name, body in (("a.csv.gz", gzip.compress("\n".join(lines[:6]).encode())),
                       ("b.csv.gz", gzip.compress("\n".join(lines[6:]).encode())),
                       ("broken.csv.gz", b"\x1f\x8b\x08 truncated")):
        s3.put_object(Bucket="inv-dest", Key=f"inv/data/{name}", Body=body)
        files.append({"key": f"inv/data/{name}", "size": len(body), "MD5checksum": "x"})
    manifest = {"sourceBucket": "inv-src", "destinationBucket": "arn:aws:s3:::inv-dest", "fileFormat": "CSV",
                "fileSchema": "Bucket, Key, VersionId, IsLatest, IsDeleteMarker, Size, LastModifiedDate, ETag",
                "files": files}
    s3.put_object(Bucket="inv-dest", Key="inv/manifest.json", Body=json.dumps(manifest).encode())
    return "inventory+s3://inv-dest/inv/manifest.json"


def table_rows(url: str, warehouse: Path) -> list[dict]:
    table = IcebergOutput(url, {"warehouse": str(warehouse)}).table
    return table.scan().to_arrow().select(["uri", "status", "error", "carried"]).to_pylist()


def snapshots(url: str, warehouse: Path) -> list:
    return IcebergOutput(url, {"warehouse": str(warehouse)}).table.metadata.snapshots


def duckdb_count(url: str, warehouse: Path) -> int:
    """Rows of the table's current snapshot by DuckDB's iceberg_scan, with the extension its PyPI package ships (the
    test extra installs them)."""
    import duckdb
    import duckdb_extension_avro
    import duckdb_extension_iceberg

    con = duckdb.connect()
    for module in (duckdb_extension_avro, duckdb_extension_iceberg):
        con.execute(f"LOAD '{glob.glob(os.path.dirname(module.__file__) + '/extensions/*/*.duckdb_extension')[0]}'")
    location = IcebergOutput(url, {"warehouse": str(warehouse)}).table.metadata_location
    return con.execute(f"SELECT count(*) FROM iceberg_scan('{location}')").fetchone()[0]


def test_inventory_into_iceberg_one_row_per_live_object_rerun_adds_no_snapshot_and_previous_carries(
        inventory, s3_server, ray_local, tmp_path):
    warehouse = tmp_path / "warehouse"
    config = dict(source=inventory, catalog_options={"warehouse": str(warehouse)}, shard_size=4, batch_size=8)
    summary = run_job(RunConfig(output="iceberg://catalog.night1", **config))
    rows = table_rows("iceberg://catalog.night1", warehouse)
    by_uri = {r["uri"]: r for r in rows}
    assert len(rows) == len(by_uri) == len(LIVE) + 2  # the live objects, the vanished one, the broken data file
    assert Counter(r["status"] for r in rows) == Counter(ok=len(LIVE), error=2)
    assert by_uri["s3://inv-src/photos/b%20c.jpg"]["status"] == "ok"  # decoded from the CSV's 'b+c.jpg'
    assert by_uri[f"s3://inv-src/{VANISHED}"]["error"].startswith("not_found: ")
    assert by_uri["s3://inv-dest/inv/data/broken.csv.gz"]["error"].startswith(
        "list_error: cannot read this manifest data file: ")
    assert summary.output == "iceberg://catalog.night1" and summary.total == len(rows)
    [snapshot] = snapshots("iceberg://catalog.night1", warehouse)
    assert snapshot.summary["bulk-classify.model"] == "efficientnet-lite0"
    assert len(snapshot.summary["bulk-classify.model-digest"]) == 64
    assert int(snapshot.summary["bulk-classify.shards"]) >= 3
    assert duckdb_count("iceberg://catalog.night1", warehouse) == len(rows)

    again = run_job(RunConfig(output="iceberg://catalog.night1", **config))
    assert again.classified == 0 and len(snapshots("iceberg://catalog.night1", warehouse)) == 1

    night2 = run_job(RunConfig(output="iceberg://catalog.night2", previous="iceberg://catalog.night1", **config))
    assert night2.carried == len(LIVE) and night2.classified == 2  # error rows are retried, never carried
    assert Counter(r["carried"] for r in table_rows("iceberg://catalog.night2", warehouse)) == Counter(
        {True: len(LIVE), False: 2})

    from pipeline.quality.statistics import compare_outputs
    from pipeline.quality.report import summarize_output

    assert summarize_output("iceberg://catalog.night2", catalog_options={"warehouse": str(warehouse)})["rows"] == \
        len(rows)
    drift = compare_outputs("iceberg://catalog.night2", "iceberg://catalog.night1",
                            catalog_options={"warehouse": str(warehouse)})
    assert drift["passed"], drift["breaches"]


def test_a_second_run_on_the_same_table_at_once_is_refused(inventory, s3_server, tmp_path):
    warehouse = tmp_path / "warehouse"
    table = IcebergOutput("iceberg://catalog.busy", {"warehouse": str(warehouse)})
    fs, root = open_fs(table.data_folder)
    fs.makedirs(root, exist_ok=True)
    lease = Lease(fs, root, table.data_folder).acquire()  # the first run holds it
    try:
        with pytest.raises(LeaseHeld, match="another run"):
            run_job(RunConfig(source=inventory, output="iceberg://catalog.busy",
                              catalog_options={"warehouse": str(warehouse)}))
    finally:
        lease.release()
    assert IcebergOutput("iceberg://catalog.busy", {"warehouse": str(warehouse)}).table is None


def test_a_list_failing_mid_listing_is_a_list_error_row_and_the_next_listing_is_whole(s3_server, monkeypatch):
    """The S3 endpoint goes away after the first LIST page; it comes back with its data (in-process moto)."""
    import boto3
    from moto.server import ThreadedMotoServer

    monkeypatch.setattr(source, "S3_PAGE", 10)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket="flaky")
        for i in range(35):
            boto3.client("s3", endpoint_url=url).put_object(Bucket="flaky", Key=f"p/{i:03d}.jpg", Body=b"x")
        options = {"endpoint_url": url, "config_kwargs": {"retries": {"max_attempts": 1}},
                   "skip_instance_cache": True}
        fs, root = open_fs("s3://flaky/p", options)
        [[unit]] = plan_listing(fs, root, DEFAULT_EXTENSIONS, 1)
        entries = list_unit(fs, unit, DEFAULT_EXTENSIONS)
        first = [next(entries) for _ in range(10)]
        server.stop()  # the page after this one fails
        rest = list(entries)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        *listed, error = first + rest  # the keys of the page in hand, then one row for the rest
        assert [e[0] for e in listed] == [f"s3://flaky/p/{i:03d}.jpg" for i in range(len(listed))]
        assert 10 <= len(listed) < 35
        last = f"p/{len(listed) - 1:03d}.jpg"
        assert error[0] == f"s3://flaky/{last}/" and error[4].startswith(
            f"list_error: cannot list the keys after '{last}' under s3://flaky/p/: ")
        fs, root = open_fs("s3://flaky/p", options)
        assert len([e for g in plan_listing(fs, root, DEFAULT_EXTENSIONS, 1) for u in g
                    for e in list_unit(fs, u, DEFAULT_EXTENSIONS)]) == 35
    finally:
        server.stop()


def test_follow_symlinks_lists_a_folder_reached_from_two_listing_tasks_once(ray_local, tmp_path):
    src, outside = tmp_path / "src", tmp_path / "outside"
    outside.mkdir()
    for i in range(3):
        (outside / f"o{i}.jpg").write_bytes(make_jpeg(900 + i))
    for name in ("a", "b"):  # two folders, so two listing tasks, each with a link to the same outside folder
        (src / name).mkdir(parents=True)
        (src / name / "own.jpg").write_bytes(make_jpeg(ord(name)))
        (src / name / "shared").symlink_to(outside)
    summary = run_job(RunConfig(source=str(src), output=str(tmp_path / "out"), follow_symlinks=True, list_tasks=2))
    import pyarrow.dataset as pads

    uris = pads.dataset(str(tmp_path / "out"), format="parquet").to_table(columns=["uri"]).column("uri").to_pylist()
    assert len(uris) == len(set(uris)) == summary.total == 5
    assert sorted(u.rsplit("/", 1)[-1] for u in uris) == ["o0.jpg", "o1.jpg", "o2.jpg", "own.jpg", "own.jpg"]


@pytest.mark.slow
def test_kill_minus_nine_mid_run_into_iceberg_then_rerun_gives_one_row_per_input(tmp_path):
    from test_faults import kill_tree, write_images

    src, warehouse = tmp_path / "src", tmp_path / "warehouse"
    write_images(src, 600)
    data = warehouse / "cat" / "night" / "data"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(src), "-o", "iceberg://cat.night", "-q",
           "--catalog-option", f"warehouse={warehouse}", "--shard-size", "20", "--batch-size", "10"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and len(list(data.rglob("part-*.parquet"))) < 3:
        time.sleep(0.1)
    assert proc.poll() is None, "the run finished before it could be killed"
    kill_tree(proc)
    assert list(data.rglob("part-*.parquet")), "no shard written before the kill"
    assert IcebergOutput("iceberg://cat.night", {"warehouse": str(warehouse)}).table is None  # nothing committed
    subprocess.run(cmd, check=True, timeout=600)
    rows = table_rows("iceberg://cat.night", warehouse)
    assert len(rows) == len({r["uri"] for r in rows}) == 600
    assert len(snapshots("iceberg://cat.night", warehouse)) == 1
    assert duckdb_count("iceberg://cat.night", warehouse) == 600
