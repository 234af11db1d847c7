"""Inputs from the wild through the CLI (issue 49): URI lists and manifests as their producers write them give one
row per object; what cannot be read is refused in one line, before Ray starts and before DEST is touched."""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from conftest import PHOTOS, make_jpeg

CLI = [sys.executable, "-m", "pipeline.cli"]


def bulk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=600, env=dict(os.environ))


def rows(out: Path) -> dict[str, str]:
    table = pads.dataset(str(out), format="parquet").to_table(columns=["uri", "status", "error"]).to_pylist()
    return {r["uri"]: r["error"] or r["status"] for r in table}


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def test_a_powershell_list_of_one_files_spellings_gives_one_row_per_file_under_the_prefix(tmp_path):
    images = tmp_path / "images"
    for folder in ("cam1", "cam10", "cam1x"):
        (images / folder).mkdir(parents=True)
        (images / folder / "a.jpg").write_bytes((PHOTOS / "coffee.jpg").read_bytes())
    (images / "cam1" / "a%20b.jpg").write_bytes((PHOTOS / "rocket.jpg").read_bytes())  # '%20' in its name
    lines = [f"{images}/cam1/a.jpg", "cam1/a%20b.jpg", f"{images}/cam1/a%20b.jpg", f"FILE://{images}/cam1/a.jpg",
             f"file://{images}/cam1/a%2520b.jpg", f"file://{images}/cam10/a.jpg", "cam1x/a.jpg", "# cameras"]
    # Windows PowerShell's `... > list.txt`: UTF-16 LE with a byte-order mark, CRLF
    (images / "list.txt").write_bytes("\r\n".join(lines).encode("utf-16"))
    out = tmp_path / "out"

    result = bulk("run", f"uris+{images}/list.txt", "--source-prefix", f"file://{images}/cam1/", "--output",
                  str(out), "--quiet")

    assert result.returncode == 0, result.stderr[-3000:]
    assert rows(out) == {f"file://{images}/cam1/a.jpg": "ok", f"file://{images}/cam1/a%2520b.jpg": "ok"}


@pytest.fixture(scope="module")
def inventory_buckets(s3):
    """A source bucket of two photos and the CSV.gz data file of their inventory, in its destination bucket."""
    for bucket in ("inputs-src", "inputs-inv"):
        s3.create_bucket(Bucket=bucket)
    for i, key in enumerate(("photos/a.jpg", "photos/b c.jpg")):
        s3.put_object(Bucket="inputs-src", Key=key, Body=make_jpeg(400 + i))
    s3.put_object(Bucket="inputs-inv", Key="inv/data/one.csv.gz",
                  Body=gzip.compress(b'"photos/a.jpg","600"\r\n"photos/b+c.jpg","600"\r\n'))
    s3.put_object(Bucket="inputs-inv", Key="inv/data/two.csv.gz", Body=gzip.compress(b""))
    return s3


def put_manifest(s3, name: str, manifest: dict, encoding: str = "utf-8") -> str:
    s3.put_object(Bucket="inputs-inv", Key=f"inv/{name}", Body=json.dumps(manifest, indent=1).encode(encoding))
    return f"inventory+s3://inputs-inv/inv/{name}"


def test_a_hand_written_manifest_in_boto3s_spelling_gives_its_rows(inventory_buckets, tmp_path):
    source = put_manifest(inventory_buckets, "boto3.json", {
        "SourceBucket": "inputs-src", "DestinationBucket": "inputs-inv", "FileFormat": "CSV",
        "FileSchema": "Key, Size", "Files": [{"Key": "inv/data/one.csv.gz", "Size": 1}, "inv/data/two.csv.gz"]},
        encoding="utf-8-sig")

    result = bulk("run", source, "--output", str(tmp_path / "out"), "--quiet")

    assert result.returncode == 0, result.stderr[-3000:]
    assert rows(tmp_path / "out") == {"s3://inputs-src/photos/a.jpg": "ok", "s3://inputs-src/photos/b%20c.jpg": "ok"}


def test_inputs_that_cannot_be_read_are_refused_in_one_line_before_ray_or_dest(inventory_buckets, tmp_path):
    (tmp_path / "list.txt").write_bytes(codecs.BOM_UTF8 + f"{PHOTOS}/coffee.jpg\r\ngs://bucket/x.jpg\r\n".encode())
    (tmp_path / "afile").write_text("a file, not a folder")
    bad_files = put_manifest(inventory_buckets, "bad.json", {
        "sourceBucket": "inputs-src", "destinationBucket": "arn:aws:s3:::inputs-inv", "fileFormat": "CSV",
        "fileSchema": "Key, Size", "files": [{"key": "inv/data/one.csv.gz"}, {"path": "inv/data/two.csv.gz"}]})
    (tmp_path / "manifest.json").write_text(json.dumps({"sourceBucket": "inputs-src", "destinationBucket": "inputs-inv",
                                                        "fileFormat": "CSV", "fileSchema": "Key",
                                                        "files": ["inv/data/one.csv.gz"]}))
    out = tmp_path / "out"
    cases = [
        (["run", f"uris+{tmp_path}/list.txt", "--output", str(out)],
         f"Error: URI list 'uris+{tmp_path}/list.txt' names gs:// objects ('gs://bucket/x.jpg') but no fsspec file "
         "system for gs:// is installed here (Please install gcsfs to access Google Storage); install it, or leave "
         "those lines out (--source-prefix keeps one store's)", 1),
        (["run", bad_files, "--output", str(out)],
         f"Error: manifest.json '{bad_files}': files[1] (fields path) names no data file; give each as "
         '{"key": "KEY"} (S3 Inventory\'s own form) or as the key itself', 1),
        (["run", f"inventory+{tmp_path}/manifest.json", "--output", str(out)],
         f"Error: manifest.json 'inventory+{tmp_path}/manifest.json' is not on S3: an S3 Inventory report is read "
         "where S3 delivered it, its data files from its destinationBucket; give "
         "inventory+s3://BUCKET/…/manifest.json", 1),
        (["run", str(PHOTOS), "--output", f"{tmp_path}/afile/sub"],
         f"Error: --output '{tmp_path}/afile/sub' is under '{tmp_path}/afile', which is a file, so no folder can be "
         "made there; choose another --output (or move that file)", 1),
        (["nightly", "--source", str(PHOTOS), "--output-root", f"{tmp_path}/afile", "--date", "2026-12-06"],
         f"Error: --output-root '{tmp_path}/afile': '{tmp_path}/afile' is a file, so no date folder can be made "
         "there; choose another --output-root (or move that file)", 2),
    ]
    if importlib.util.find_spec("gcsfs") is not None:  # the first case is about a machine without it
        cases = cases[1:]
    for args, message, status in cases:
        result = bulk(*args)
        assert (result.returncode, one_line(result)) == (status, message)
        assert not out.exists() and (tmp_path / "afile").read_text() == "a file, not a folder"

