"""Manifest sources without storage servers: URI lists and S3 Inventory data files on local disk."""

from __future__ import annotations

import codecs
import gzip
import importlib.util
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
    check_source(fs, root, source, EXT, source_prefix=prefix)
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


# ---- inputs as their producers write them (issue 49) ----

@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-be-bom", "utf-32"])
def test_a_uri_list_with_a_byte_order_mark_and_crlf_lists_the_same_uris(tmp_path, encoding):
    lines = [f"{tmp_path}/a.jpg", f"file://{tmp_path}/b.jpg", "s3://b/c d.jpg", "rel/e.jpg"]
    text = "\r\n".join(lines) + "\r\n"
    data = codecs.BOM_UTF16_BE + text.encode("utf-16-be") if encoding == "utf-16-be-bom" else text.encode(encoding)
    (tmp_path / "list.txt").write_bytes(data)
    (tmp_path / "list.txt.gz").write_bytes(gzip.compress(data))
    expected = [(f"file://{tmp_path}/a.jpg", None, None, None), (f"file://{tmp_path}/b.jpg", None, None, None),
                ("s3://b/c%20d.jpg", None, None, None), (f"file://{tmp_path}/rel/e.jpg", None, None, None)]
    assert listed(f"uris+{tmp_path}/list.txt") == expected
    assert listed(f"uris+{tmp_path}/list.txt.gz") == expected
    (tmp_path / "list.csv").write_bytes(("uri,size\r\n" + "".join(f"{u},1\r\n" for u in lines)).encode(
        "utf-16" if encoding == "utf-16-be-bom" else encoding))
    assert listed(f"uris+{tmp_path}/list.csv") == [(u, 1, None, None) for u, *_ in expected]


def test_a_text_list_in_another_encoding_is_one_list_error_row_saying_how_to_fix(tmp_path):
    (tmp_path / "list.txt").write_bytes(f"{tmp_path}/caf\u00e9.jpg\n".encode("latin-1"))
    [entry] = listed(f"uris+{tmp_path}/list.txt")
    assert entry[0] == f"file://{tmp_path}/list.txt"
    assert entry[4] == ("list_error: cannot read this manifest data file: ValueError: it is not UTF-8 text (bytes e9 "
                        "2e 6a 70: invalid continuation byte); save it as UTF-8 (a byte-order mark and CRLF line ends "
                        "are fine); the objects it names get rows on the run after it is fixed")


def test_a_path_is_taken_as_written_relative_or_absolute_and_a_uri_is_percent_decoded_once(tmp_path):
    folder = tmp_path / "my%20photos"  # a folder whose name holds '%20', as wget saves one
    folder.mkdir()
    (folder / "list.txt").write_text(f"{folder}/a%20b.jpg\na%20b.jpg\n./a%20b.jpg\nsub/../a%20b.jpg\n"
                                     f"file://{tmp_path}/my%2520photos/a%2520b.jpg\n"
                                     f"FILE://{tmp_path}/my%2520photos/a%2520b.jpg\nS3://b/x%20y.jpg\n")
    same = f"file://{tmp_path}/my%2520photos/a%2520b.jpg"  # the file named a%20b.jpg, six times
    assert [e[0] for e in listed(f"uris+{folder}/list.txt")] == [same] * 6 + ["s3://b/x%20y.jpg"]


@pytest.mark.parametrize("prefix", ["file://{d}/cam1/", "file://{d}/cam1", "{d}/cam1/", "{d}/cam1"])
def test_source_prefix_matches_whole_path_segments_on_every_scheme(tmp_path, prefix):
    names = ["cam1/a.jpg", "cam10/a.jpg", "cam1x/a.jpg", "cam1/deep/b.jpg"]
    (tmp_path / "list.txt").write_text("".join(f"file://{tmp_path}/{n}\ns3://b/{n}\n" for n in names))
    kept = [f"file://{tmp_path}/cam1/a.jpg", f"file://{tmp_path}/cam1/deep/b.jpg"]
    assert [e[0] for e in listed(f"uris+{tmp_path}/list.txt", prefix=prefix.format(d=tmp_path))] == kept
    for s3_prefix in ("s3://b/cam1/", "s3://b/cam1"):
        assert [e[0] for e in listed(f"uris+{tmp_path}/list.txt", prefix=s3_prefix)] == [
            "s3://b/cam1/a.jpg", "s3://b/cam1/deep/b.jpg"]


MANIFEST = {"sourceBucket": "src-bucket", "destinationBucket": "arn:aws:s3:::inv-dest", "fileFormat": "CSV",
            "fileSchema": "Bucket, Key, Size"}


@pytest.mark.parametrize("files, spelling", [
    ([{"key": "inv/data/a.csv.gz", "size": 1, "MD5checksum": "x"}, {"key": "inv/data/b.csv.gz"}], {}),  # AWS's
    ([{"Key": "inv/data/a.csv.gz", "Size": 1}, {"Key": "inv/data/b.csv.gz"}], {}),  # boto3's spelling
    (["inv/data/a.csv.gz", "inv/data/b.csv.gz"], {}),  # plain keys
    ([{"KEY": "inv/data/a.csv.gz"}, "inv/data/b.csv.gz"], {"utf-8-sig": True}),  # mixed, with a byte-order mark
    ([{"key": "inv/data/a.csv.gz"}, {"key": "inv/data/b.csv.gz"}], {"utf-16": True, "Capitalised": True}),
])
def test_a_manifest_json_in_either_spelling_plans_its_data_files(tmp_path, files, spelling):
    from pipeline.io.source_manifest import plan_manifest
    from pipeline.storage import INVENTORY_FORM

    manifest = {**MANIFEST, "files": files}
    if spelling.get("Capitalised"):
        manifest = {k[0].upper() + k[1:]: v for k, v in manifest.items()}
    text = json.dumps(manifest, indent=2).replace("\n", "\r\n")
    encoding = next((e for e in ("utf-8-sig", "utf-16") if spelling.get(e)), "utf-8")
    (tmp_path / "manifest.json").write_bytes(text.encode(encoding))
    fs, path = open_fs(f"inventory+{tmp_path}/manifest.json")
    units = plan_manifest(fs, INVENTORY_FORM, path, f"inventory+{tmp_path}/manifest.json")
    assert [(u.url, u.fmt, u.columns, u.bucket) for u in units] == [
        (f"s3://inv-dest/inv/data/{n}.csv.gz", "CSV", ("Bucket", "Key", "Size"), "src-bucket") for n in "ab"]


@pytest.mark.parametrize("change, message", [
    ({"files": [{"key": "a.csv.gz"}, {"path": "b.csv.gz", "size": 1}]},
     r"files\[1\] \(fields path, size\) names no data file; give each as \{\"key\": \"KEY\"\} \(S3 Inventory's own "
     r"form\) or as the key itself$"),
    ({"files": ["a.csv.gz", 7]}, r"files\[1\] \(7\) names no data file; give each as"),
    ({"files": [{"key": ""}]}, r"files\[0\] \(fields key\) names no data file"),
    ({"fileSchema": None}, r"fileSchema None names no Key column; a CSV report's data files have no header, so "
                           r"fileSchema lists their columns, e\.g\. \"Bucket, Key, Size\"$"),
    ({"sourceBucket": None, "fileSchema": "Key, Size"},
     r"no sourceBucket, and no Bucket column in fileSchema, so its keys name no bucket; add "
     r"\"sourceBucket\": \"BUCKET\"$"),
    ({"destinationBucket": None}, r"no destinationBucket, the bucket its data files are in; add "
                                  r"\"destinationBucket\": \"arn:aws:s3:::BUCKET\"$"),
])
def test_a_manifest_json_missing_what_the_listing_needs_fails_in_one_line_naming_the_field(tmp_path, change, message):
    from pipeline.io.source_manifest import read_inventory_manifest

    manifest = {**MANIFEST, "files": [{"key": "a.csv.gz"}], **change}
    (tmp_path / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if v is not None}))
    fs, path = open_fs(str(tmp_path / "manifest.json"))
    with pytest.raises(SourceError, match=rf"^manifest.json 'inventory\+{tmp_path}/manifest.json': {message}"):
        read_inventory_manifest(fs, path, f"inventory+{tmp_path}/manifest.json")


def test_a_manifest_json_not_on_s3_is_refused_in_one_line(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({**MANIFEST, "files": [{"key": "a.csv.gz"}]}))
    with pytest.raises(SourceError, match=rf"^manifest.json 'inventory\+{tmp_path}/manifest.json' is not on S3: an S3 "
                                          r"Inventory report is read where S3 delivered it, its data files from its "
                                          r"destinationBucket; give inventory\+s3://BUCKET/…/manifest.json$"):
        listed(f"inventory+{tmp_path}/manifest.json")


def test_a_uri_list_naming_a_scheme_no_file_system_opens_is_refused_in_one_line_naming_the_package(tmp_path):
    pytest.importorskip("s3fs")
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here")
    (tmp_path / "list.txt").write_text(f"{tmp_path}/a.jpg\ns3://b/c.jpg\ngs://bucket/photos/x.jpg\n")
    with pytest.raises(SourceError, match=rf"^URI list 'uris\+{tmp_path}/list.txt' names gs:// objects "
                                          r"\('gs://bucket/photos/x.jpg'\) but no fsspec file system for gs:// is "
                                          r"installed here \(Please install gcsfs to access Google Storage\); "
                                          r"install it, or leave those lines out \(--source-prefix keeps one "
                                          r"store's\)$"):
        listed(f"uris+{tmp_path}/list.txt")
    pq.write_table(pa.table({"uri": ["s3://b/a.jpg", "nosuchfs://b/z.png"]}), tmp_path / "list.parquet")
    with pytest.raises(SourceError, match=r"names nosuchfs:// objects \('nosuchfs://b/z.png'\) but no fsspec file "
                                          r"system for nosuchfs:// is installed here \(fsspec knows no scheme "
                                          r"'nosuchfs'\); install it"):
        listed(f"uris+{tmp_path}/list.parquet")
    # what the listing would not keep is not asked for: another extension, or out of --source-prefix
    (tmp_path / "list.txt").write_text("s3://b/c.jpg\ngs://bucket/notes.txt\ngs://bucket/x.jpg\n")
    assert [e[0] for e in listed(f"uris+{tmp_path}/list.txt", prefix="s3://b/")] == ["s3://b/c.jpg"]


def test_an_unreadable_data_file_row_names_it_percent_encoded(tmp_path):
    bad = tmp_path / "bad list.csv"
    bad.write_bytes(b"\x1f\x8b not gzip")
    [entry] = listed(f"uris+{bad}")
    assert entry[0] == f"file://{tmp_path}/bad%20list.csv"


def test_an_empty_data_file_names_no_object(tmp_path):
    (tmp_path / "empty.csv.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "empty.csv").write_bytes(b"")
    fs, _ = open_fs(str(tmp_path))
    for name in ("empty.csv.gz", "empty.csv"):
        inventory = InventoryFile(f"file://{tmp_path}/{name}", "CSV", INVENTORY_COLUMNS, "b")
        assert list(inventory.entries(fs, EXT, True)) == []
        assert list(UriListFile(f"file://{tmp_path}/{name}").entries(fs, EXT, True)) == []


def test_local_file_uris_as_hadoop_and_java_write_them_and_csv_cells_with_blanks_name_the_same_file(tmp_path):
    (tmp_path / "spark.txt").write_text(f"file:{tmp_path}/a.jpg\nfile://localhost{tmp_path}/a.jpg\n")
    assert [e[0] for e in listed(f"uris+{tmp_path}/spark.txt")] == [f"file://{tmp_path}/a.jpg"] * 2
    (tmp_path / "list.csv").write_text(f"uri,size\n  file://{tmp_path}/a.jpg ,1\n")  # a spreadsheet's padding
    assert listed(f"uris+{tmp_path}/list.csv") == [(f"file://{tmp_path}/a.jpg", 1, None, None)]


def test_a_spreadsheets_csv_in_windows_1252_is_one_list_error_row_saying_to_save_it_as_utf8(tmp_path):
    (tmp_path / "list.csv").write_bytes("uri\ns3://b/caf\u00e9.jpg\n".encode("cp1252"))
    [entry] = listed(f"uris+{tmp_path}/list.csv")
    assert entry[4] == ("list_error: cannot read this manifest data file: ValueError: its 'uri' column is not UTF-8 "
                        "text (Invalid UTF8 payload); save it as UTF-8 (a byte-order mark and CRLF line ends are fine);"
                        " the objects it names get rows on the run after it is fixed")


def test_a_parquet_lists_footer_tells_its_schemes_when_every_row_group_holds_one(tmp_path):
    from pipeline.io.source_manifest import _footer_schemes

    def schemes(uris: list[str], rows: int) -> set[str] | None:
        pq.write_table(pa.table({"size": [1] * len(uris), "uri": uris}), tmp_path / "l.parquet", row_group_size=rows)
        return _footer_schemes(pq.ParquetFile(tmp_path / "l.parquet").metadata, "uri")

    assert schemes(["s3://b/a.jpg", "s3://c/z.jpg"], 2) == {"s3"}  # not read: s3 opens
    assert schemes(["gs://b/a.jpg", "s3://b/z.jpg"], 1) == {"gs", "s3"}  # gs does not: read, then refused
    for mixed in (["gs://b/a.jpg", "s3://b/z.jpg"], ["/abs/a.jpg", "s3://b/z.jpg"], ["S3://b/a.jpg", "s3://b/z.jpg"]):
        assert schemes(mixed, 2) is None
