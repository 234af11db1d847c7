"""Manifest sources without storage servers: URI lists and S3 Inventory data files on local disk."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.orc as po
import pyarrow.parquet as pq
import pytest

from pipeline.config import DEFAULT_EXTENSIONS, RunConfig
from pipeline.errors import ConfigError, SourceError
from pipeline.io.keys import identity_hashes
from pipeline.io.source import check_source, list_unit, listing_blocks, plan_listing
from pipeline.io.source_local import walk_local
from pipeline.io.source_manifest import InventoryFile, UriListFile, _footer_rows, planned_entries
from pipeline.storage import open_fs

EXT = DEFAULT_EXTENSIONS
INVENTORY_COLUMNS = ("Bucket", "Key", "VersionId", "IsLatest", "IsDeleteMarker", "Size", "LastModifiedDate", "ETag")
# (key, version, latest, delete marker): one live object, a space in its name, an older version, a deleted object
INVENTORY_ROWS = [
    ("photos/a.jpg", "v2", "true", "false"),
    ("photos/b c.jpg", "v1", "true", "false"),
    ("photos/a.jpg", "v1", "false", "false"),
    ("photos/gone.jpg", "v3", "true", "true"),
    ("photos/notes.txt", "v1", "true", "false"),
    ("other/d.png", "v1", "true", "false"),
]
LIVE = ["s3://src-bucket/photos/a.jpg", "s3://src-bucket/photos/b%20c.jpg", "s3://src-bucket/other/d.png"]


def listed(source: str, prefix: str | None = None) -> list[tuple]:
    fs, root = open_fs(source)
    check_source(fs, root, source, EXT)
    groups = plan_listing(fs, root, EXT, 4, source=source, source_prefix=prefix)
    return [e for group in groups for unit in group for e in list_unit(fs, unit, EXT)]


def test_text_csv_and_parquet_uri_lists_give_canonical_uris_with_their_versions(tmp_path):
    (tmp_path / "list.txt").write_text("# a comment\ns3://b/a b.jpg\n\nphotos/rel.jpg\n/abs/x.PNG\ns3://b/n.txt\n")
    assert listed(f"uris+{tmp_path}/list.txt") == [
        ("s3://b/a%20b.jpg", None, None, None), (f"file://{tmp_path}/photos/rel.jpg", None, None, None),
        ("file:///abs/x.PNG", None, None, None)]
    (tmp_path / "list.csv").write_text("uri,size_bytes,etag,mtime\ns3://b/1.jpg,5,\"e1\",2026-01-01T00:00:00Z\n")
    assert listed(f"uris+{tmp_path}/list.csv") == [("s3://b/1.jpg", 5, "e1", 1767225600000000)]
    table = pa.table({"uri": ["s3://b/p%20q.jpg", "s3://b/z.jpg", "s3://c/y.jpg"], "size": [3, 4, 5]})
    pq.write_table(table, tmp_path / "list.parquet", row_group_size=1)
    fs, root = open_fs(f"uris+{tmp_path}/list.parquet")
    units = [u for g in plan_listing(fs, root, EXT, 8, source=f"uris+{tmp_path}/list.parquet") for u in g]
    assert [u.row_groups for u in units] == [(0,), (1,), (2,)]  # a row group per unit: read in parallel
    assert planned_entries([units]) == 3  # the progress total, from the footer, before anything is listed
    assert planned_entries([[UriListFile("file:///list.txt")]]) is None
    assert listed(f"uris+{tmp_path}/list.parquet", prefix="s3://b/") == [
        ("s3://b/p%20q.jpg", 3, None, None), ("s3://b/z.jpg", 4, None, None)]


def test_a_missing_list_or_a_manifest_that_is_not_one_fails_before_work(tmp_path):
    with pytest.raises(SourceError, match="URI list .* does not exist; check the URL after 'uris\\+'"):
        listed(f"uris+{tmp_path}/nope.txt")
    (tmp_path / "manifest.json").write_text(json.dumps({"fileFormat": "JSON", "files": []}))
    with pytest.raises(SourceError, match="is not an S3 Inventory manifest"):
        listed(f"inventory+{tmp_path}/manifest.json")
    with pytest.raises(ConfigError, match="--source-prefix filters a manifest"):
        RunConfig(source=str(tmp_path), output=str(tmp_path / "o"), source_prefix="s3://b/")
    with pytest.raises(ConfigError, match="without @SNAPSHOT, and is never overwritten"):
        RunConfig(source=str(tmp_path), output="iceberg://ns.t", overwrite=True)
    with pytest.raises(ConfigError, match="'iceberg://table' is not an Iceberg table; write iceberg://NAMESPACE.TABLE"):
        RunConfig(source=str(tmp_path), output=str(tmp_path / "o"), previous="iceberg://table")


def _inventory_csv(rows) -> bytes:
    from urllib.parse import quote_plus

    lines = [f'"src-bucket","{quote_plus(k, safe="/")}","{v}","{latest}","{deleted}","7",'
             f'"2026-12-01T05:10:44.000Z","etag-{v}"' for k, v, latest, deleted in rows]
    return gzip.compress(("\n".join(lines) + "\n").encode())


def _inventory_table(rows) -> pa.Table:
    return pa.table({
        "bucket": ["src-bucket"] * len(rows), "key": [r[0] for r in rows], "version_id": [r[1] for r in rows],
        "is_latest": [r[2] == "true" for r in rows], "is_delete_marker": [r[3] == "true" for r in rows],
        "size": pa.array([7] * len(rows), pa.int64()), "last_modified_date": pa.array(
            [1796101844000] * len(rows), pa.timestamp("ms")), "e_tag": [f"etag-{r[1]}" for r in rows]})


@pytest.mark.parametrize("fmt", ["CSV", "Parquet", "ORC"])
def test_inventory_data_files_skip_old_versions_delete_markers_and_other_extensions(tmp_path, fmt):
    path = tmp_path / "data.bin"
    if fmt == "CSV":
        path.write_bytes(_inventory_csv(INVENTORY_ROWS))
    elif fmt == "Parquet":
        pq.write_table(_inventory_table(INVENTORY_ROWS), path)
    else:
        po.write_table(_inventory_table(INVENTORY_ROWS), str(path))
    fs, _ = open_fs(str(tmp_path))
    assert _footer_rows(fs, [f"file://{path}"], fmt) == [None if fmt == "CSV" else len(INVENTORY_ROWS)]
    entries = list(InventoryFile(f"file://{path}", fmt, INVENTORY_COLUMNS, "src-bucket").entries(fs, EXT, True))
    assert [e[0] for e in entries] == LIVE
    assert entries[0][1:] == (7, "etag-v2", 1796101844000000)
    prefixed = InventoryFile(f"file://{path}", fmt, INVENTORY_COLUMNS, "src-bucket", "s3://src-bucket/photos/")
    assert [e[0] for e in prefixed.entries(fs, EXT, True)] == LIVE[:2]


def test_an_unreadable_data_file_is_one_list_error_entry_naming_it(tmp_path):
    good, bad = tmp_path / "good.csv.gz", tmp_path / "bad.csv.gz"
    good.write_bytes(_inventory_csv(INVENTORY_ROWS))
    bad.write_bytes(b"\x1f\x8b not gzip at all")
    fs, _ = open_fs(str(tmp_path))
    units = [InventoryFile(f"file://{p}", "CSV", INVENTORY_COLUMNS, "src-bucket") for p in (bad, good)]
    entries = [e for u in units for e in list_unit(fs, u, EXT)]
    assert [e[0] for e in entries] == [f"file://{bad}"] + LIVE
    assert entries[0][4].startswith("list_error: cannot read this manifest data file: ")
    missing = UriListFile(f"file://{tmp_path}/missing.parquet")
    assert [e[4][:18] for e in list_unit(fs, missing, EXT)] == ["list_error: cannot"]


def test_a_listed_object_without_a_version_is_never_carried(tmp_path):
    (tmp_path / "list.csv").write_text("uri,etag\ns3://b/v.jpg,e1\ns3://b/no-version.jpg,\n")
    fs, root = open_fs(f"uris+{tmp_path}/list.csv")
    groups = plan_listing(fs, root, EXT, 1, source=f"uris+{tmp_path}/list.csv")
    # the previous run holds both as they would be hashed: only the one with an ETag may be carried
    previous = np.sort(identity_hashes(["s3://b/v.jpg", "s3://b/no-version.jpg"], ["e1", None], [None, None],
                                       [None, None]))
    carried = []
    blocks = list(listing_blocks(fs, groups[0], EXT, done=np.empty(0, np.int64), previous=previous, named=True,
                                 report=lambda listed, skipped, s, ids: carried.append(ids)))
    assert [u for b in blocks for u in b.column("uri").to_pylist()] == ["s3://b/no-version.jpg"]
    assert sum(c.size for c in carried if c is not None) == 1


def test_a_folder_out_of_the_source_reached_by_two_links_is_walked_by_the_first_claim(tmp_path):
    src, outside = tmp_path / "src", tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "x.jpg").write_bytes(b"x")
    for name in ("a", "b"):
        (src / name).mkdir(parents=True)
        (src / name / "ext").symlink_to(outside)
    claimed: set = set()

    def claim(folder):  # what the listing counter does for the listing tasks
        first = folder not in claimed
        claimed.add(folder)
        return first

    uris = [e[0] for name in ("a", "b") for e in walk_local(str(src / name), EXT, root=str(src), follow=True,
                                                             claim=claim)]
    assert uris == [f"file://{src}/a/ext/deep/x.jpg"]


def test_an_object_a_manifest_names_twice_keeps_one_row_when_the_output_is_made_unique(tmp_path):
    import pyarrow.dataset as pads

    from pipeline.job.output import dedupe_output
    from pipeline.io.writer import write_shard

    out = str(tmp_path / "out")
    # one shard holds a.jpg twice (a manifest's duplicate line); c.jpg is in two shards
    write_shard(pa.table({"uri": ["s3://b/a.jpg", "s3://b/a.jpg", "s3://b/c.jpg"], "status": ["ok"] * 3}),
                output=out, storage_options={})
    write_shard(pa.table({"uri": ["s3://b/c.jpg", "s3://b/d.jpg"], "status": ["ok"] * 2}), output=out,
                storage_options={})
    fs, root = open_fs(out)
    assert dedupe_output(fs, root, out) == 2
    uris = pads.dataset(out, format="parquet").to_table(columns=["uri"]).column("uri").to_pylist()
    assert sorted(uris) == ["s3://b/a.jpg", "s3://b/c.jpg", "s3://b/d.jpg"]
