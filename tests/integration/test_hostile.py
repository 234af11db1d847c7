"""Hostile but ordinary use (issue 22's reproductions): each gives the right rows, or one line and a non-zero exit with
DEST (and the source) exactly as they were."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from conftest import make_jpeg
from support.ray_cluster import LocalRayCluster
from pipeline.columns import conform
from pipeline.config import RunConfig
from pipeline.io.keys import legacy_uri, uri_path
from pipeline.io.reader import committed_parts
from pipeline.io.writer import write_json, write_shard
from pipeline.job import run_job
from pipeline.job.lease import Lease, LeaseHeld
from pipeline.job.output import dedupe_output, remove_owned
from pipeline.schema import LEASE, OUTPUT_SCHEMA, SUCCESS
from pipeline.storage import open_fs
from support.paths import REPO

PHOTOS = REPO / "tests" / "data" / "photos"
BC = [sys.executable, "-m", "pipeline.cli"]
ESC_TITLE = "\x1b]0;owned\x07"  # a terminal escape that retitles the window

# ---- the source and its listing: odd names, links, folders that cannot be read, empty sources, pixel caps ----

ODD_NAMES = ["a#b.jpg", "q?x=1.jpg", "%20.jpg", "sp ace.jpg", "caf\u00e9.jpg", "+plus+.jpg", "x..y.jpg",
             f"t{ESC_TITLE}.jpg", "<b>&amp;.jpg", "100%.jpg"]
NOT_UTF8 = b"bad\xff\xfe.jpg"


def _photo(name: str = "astronaut") -> bytes:
    return (PHOTOS / f"{name}.jpg").read_bytes()


def _rows(out: Path) -> list[dict]:
    return pads.dataset(str(out), format="parquet").to_table(columns=["uri", "status", "error"]).to_pylist()


def _hostile_tree(tmp: Path) -> tuple[Path, Path]:
    """A source with odd names, a name that is not UTF-8, links in and out of it and a loop; and the outside."""
    src, outside = tmp / "src", tmp / "outside"
    (src / "sub").mkdir(parents=True)
    (src / "real").mkdir()
    outside.mkdir()
    (src / "plain.jpg").write_bytes(_photo())
    for name in ODD_NAMES:
        (src / "sub" / name).write_bytes(_photo("coffee"))
    with open(os.path.join(os.fsencode(src), NOT_UTF8), "wb") as f:
        f.write(_photo("camera"))
    (src / "real" / "r.jpg").write_bytes(_photo("camera"))
    (outside / "secret.jpg").write_bytes(_photo("chelsea"))
    (outside / "o.jpg").write_bytes(_photo("rocket"))
    (src / "sub" / "loop").symlink_to("..")  # a link back up the tree
    (src / "alias").symlink_to("real")  # a symlinked sub-folder inside the source: listed once
    (src / "latest.jpg").symlink_to("real/r.jpg")  # a link to a listed file: listed once
    (src / "passwd.jpg").symlink_to(outside / "secret.jpg")  # out of the source
    (src / "ext").symlink_to(outside)  # a folder out of the source
    (src / "l1").symlink_to("l2")  # a loop of links
    (src / "l2").symlink_to("l1")
    (src / "broken.jpg").symlink_to("nowhere.jpg")
    return src, outside


def _uri(path: Path | bytes, folder: bool = False) -> str:
    raw = path if isinstance(path, bytes) else os.fsencode(path)
    return "file://" + urllib.parse.quote_from_bytes(raw + (b"/" if folder else b""), "/")


def _expected(src: Path, follow: bool) -> tuple[set[str], dict[str, str]]:
    """(URIs listed as files, {URI of a list_error row: words its error holds})."""
    files = {_uri(src / "plain.jpg"), _uri(src / "real" / "r.jpg"), _uri(os.fsencode(src) + b"/" + NOT_UTF8)}
    files |= {_uri(src / "sub" / n) for n in ODD_NAMES}
    errors = {_uri(src / "l1"): "symbolic link loop", _uri(src / "l2"): "symbolic link loop",
              _uri(src / "broken.jpg"): "broken symbolic link"}
    if follow:
        files |= {_uri(src / "passwd.jpg"), _uri(src / "ext" / "secret.jpg"), _uri(src / "ext" / "o.jpg")}
    else:
        errors |= {_uri(src / "passwd.jpg"): "--follow-symlinks", _uri(src / "ext", folder=True): "--follow-symlinks"}
    return files, errors


def _listed(src: Path, tasks: int, follow: bool) -> list[tuple]:
    from pipeline.config import DEFAULT_EXTENSIONS
    from pipeline.io.source import list_unit, plan_listing
    from pipeline.storage import open_fs

    fs, root = open_fs(str(src))
    groups = plan_listing(fs, root, DEFAULT_EXTENSIONS, tasks, follow_symlinks=follow)
    return [e for g in groups for unit in g for e in list_unit(fs, unit, DEFAULT_EXTENSIONS)]


@pytest.mark.parametrize("follow", [False, True])
@pytest.mark.parametrize("tasks", [1, 3])
def test_listing_of_hostile_names_and_links_is_complete_and_lists_each_file_once(tmp_path, tasks, follow):
    src, _outside = _hostile_tree(tmp_path)
    entries = _listed(src, tasks, follow)
    uris = [e[0] for e in entries]
    assert len(uris) == len(set(uris)), sorted(uris)
    files, errors = _expected(src, follow)
    assert {e[0] for e in entries if len(e) == 4} == files
    got_errors = {e[0]: e[4] for e in entries if len(e) > 4}
    assert set(got_errors) == set(errors)
    for uri, words in errors.items():
        assert got_errors[uri].startswith("list_error: ") and words in got_errors[uri], got_errors[uri]
    assert all(e[1] is not None for e in entries if len(e) == 4)  # stat-ed, the non-UTF-8 name included


def test_a_rerun_finds_every_entry_and_list_error_row_done(tmp_path):
    import numpy as np

    from pipeline.config import DEFAULT_EXTENSIONS
    from pipeline.io.keys import uri_hashes
    from pipeline.io.source import listing_blocks, plan_listing
    from pipeline.storage import open_fs

    src, _outside = _hostile_tree(tmp_path)
    fs, root = open_fs(str(src))
    groups = plan_listing(fs, root, DEFAULT_EXTENSIONS, 1)
    first = [b for b in listing_blocks(fs, groups[0], DEFAULT_EXTENSIONS, done=np.empty(0, np.int64),
                                       previous=np.empty(0, np.int64))]
    table = first[0] if len(first) == 1 else pa.concat_tables(first)
    files, errors = _expected(src, follow=False)
    assert sorted(table.column("uri").to_pylist()) == sorted(files | set(errors))
    rows = dict(zip(table.column("uri").to_pylist(), table.column("error").to_pylist()))
    assert all(rows[u] is None for u in files) and all(rows[u].startswith("list_error: ") for u in errors)
    done = np.unique(uri_hashes(table.column("uri").to_pylist()))
    reports = []
    again = list(listing_blocks(fs, groups[0], DEFAULT_EXTENSIONS, done=done, previous=np.empty(0, np.int64),
                                report=lambda *args: reports.append(args)))
    assert sum(b.num_rows for b in again) == 0 and sum(r[1] for r in reports) == len(files) + len(errors)


def test_uris_are_urls_that_parse_back_to_the_same_file(tmp_path):
    import fsspec
    import pyarrow.fs as pafs

    src, _outside = _hostile_tree(tmp_path)
    entries = [e for e in _listed(src, 2, False) if len(e) == 4]
    for uri, size, _etag, _mtime in entries:
        path = uri_path(uri)
        assert os.path.getsize(path) == size
        parts = urllib.parse.urlsplit(uri)
        assert (parts.scheme, parts.netloc, parts.query, parts.fragment) == ("file", "", "", "")
        assert urllib.parse.unquote_to_bytes(parts.path) == os.fsencode(path)
        assert all(33 <= ord(c) < 127 for c in uri), uri  # no space, control or non-ASCII character
        if os.fsencode(path).endswith(NOT_UTF8):
            continue  # not UTF-8: only the bytes parse back (pyarrow and fsspec take text paths)
        fs, arrow_path = pafs.FileSystem.from_uri(uri)
        assert arrow_path == path and fs.get_file_info(arrow_path).size == size
        # fsspec takes a file:// URL's path as it is written: it opens the path that urllib unquotes
        with fsspec.open(urllib.parse.unquote(uri), "rb") as f:
            assert len(f.read()) == size


def _unprivileged() -> list[str]:
    """A command prefix that drops root's power to read any folder (as issue 22 did), [] for a plain user."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a folder of mode 000 cannot be made unreadable")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search",
            "--"]


def test_unreadable_sub_folder_is_a_list_error_row_and_an_unreadable_source_one_line(tmp_path):
    src = tmp_path / "src"
    (src / "locked").mkdir(parents=True)
    (src / "locked" / "hidden.jpg").write_bytes(_photo())
    (src / "ok.jpg").write_bytes(_photo())
    (src / "locked").chmod(0)
    try:
        # the local listing, and fsspec's walk as other stores are listed (it leaves such a folder out unless told)
        script = ("import json, sys; from pipeline.io.source import FsDir, list_unit, plan_listing; "
                  "from pipeline.storage import open_fs; "
                  "fs, root = open_fs(sys.argv[1]); ext = ('jpg',); "
                  "print(json.dumps([[list(e) for g in plan_listing(fs, root, ext, 2) for u in g "
                  "for e in list_unit(fs, u, ext)], [list(e) for e in list_unit(fs, FsDir(root), ext)]]))")
        done = subprocess.run(_unprivileged() + [sys.executable, "-c", script, str(src)], capture_output=True,
                              text=True, cwd=REPO, timeout=120)
        assert done.returncode == 0, done.stderr
        for listing, words in zip(json.loads(done.stdout), ("cannot list this folder: ", "cannot list: ")):
            entries = {e[0]: e for e in listing}
            assert set(entries) == {_uri(src / "ok.jpg"), _uri(src / "locked", folder=True)}
            error = entries[_uri(src / "locked", folder=True)][4]
            assert error.startswith(f"list_error: {words}PermissionError: [Errno 13]"), error

        (src / "locked").chmod(0o755)
        src.chmod(0)
        out = tmp_path / "out"
        out.mkdir()
        (out / "keep.txt").write_text("x")
        run = subprocess.run(_unprivileged() + BC + ["run", str(src), "--output", str(out), "-q"],
                             capture_output=True, text=True, cwd=REPO, timeout=120)
        assert run.returncode == 1
        assert run.stderr.strip().count("\n") == 0 and "Permission denied" in run.stderr, run.stderr
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # DEST exactly as it was
    finally:
        src.chmod(0o755)
        (src / "locked").chmod(0o755)


@pytest.mark.parametrize("content", [None, "notes.txt"])
def test_empty_source_warns_in_one_line_exits_4_and_leaves_dest_alone(tmp_path, content):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (out / "keep.txt").write_text("x")
    if content:
        (src / content).write_text("not an image")
    (src / ".hidden.jpg").write_bytes(_photo())
    run = subprocess.run(BC + ["run", str(src), "--output", str(out)], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert run.returncode == 4, run.stderr
    assert run.stderr.startswith("warning: source ") and run.stderr.count("\n") == 1, run.stderr
    assert "holds no file with extension jpg,jpeg" in run.stderr and "--extensions" in run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_max_pixels_above_pillows_own_limit_applies(monkeypatch):
    import io

    from PIL import Image

    from pipeline.errors import ImageError
    from pipeline.model.imaging import DecodeLimits, decode_image

    buf = io.BytesIO()
    Image.new("RGB", (200, 100), (9, 9, 9)).save(buf, format="PNG")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000)  # Pillow alone refuses 20,000 pixels (over twice this)
    assert decode_image(buf.getvalue(), DecodeLimits(max_pixels=30_000)).size == (200, 100)
    assert Image.MAX_IMAGE_PIXELS == 30_000
    with pytest.raises(ImageError, match=r"^too_many_pixels: 200x100 = 20000 pixels is over max_pixels=10000"):
        decode_image(buf.getvalue(), DecodeLimits(max_pixels=10_000))


def test_report_escapes_control_characters_of_labels_and_paths(tmp_path):
    from datetime import datetime, timezone

    from pipeline.columns import conform
    from pipeline.schema import OUTPUT_SCHEMA
    from pipeline.io.writer import write_shard

    out = tmp_path / f"out{ESC_TITLE}"
    now = datetime.now(timezone.utc)
    row = {"status": "ok", "error": None, "class_ids": [1], "labels": [f"cat{ESC_TITLE}\u202e"], "scores": [0.9],
           "model": "m", "engine": "onnx", "size_bytes": 1, "classified_at": now, "carried": False}
    rows = [dict(row, uri=f"file:///x/{i}.jpg") for i in range(3)]
    rows.append(dict(row, uri="file:///x/bad/", status="error", error=f"list_error: {ESC_TITLE}", class_ids=None,
                     labels=None, scores=None))
    rows = conform(pa.Table.from_pylist(rows), OUTPUT_SCHEMA)
    write_shard(rows, output=str(out), storage_options={})
    run = subprocess.run(BC + ["report", str(out)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "\x1b" not in run.stdout and "\x07" not in run.stdout and "\u202e" not in run.stdout
    assert "cat\\x1b]0;owned\\x07" in run.stdout and "\\u202e" in run.stdout
    assert "not listed" in run.stdout
    missing = subprocess.run(BC + ["report", str(tmp_path / f"gone{ESC_TITLE}")], capture_output=True, text=True,
                             cwd=REPO, timeout=120)
    assert missing.returncode == 1 and "\x1b" not in missing.stderr and "\\x1b" in missing.stderr


def test_hostile_source_end_to_end_gives_one_row_per_entry_and_counts_list_errors(tmp_path):
    """Issue 22's reproductions 3, 4 and 8 in one run of the command line, with root's read-anything power dropped."""
    src, _outside = _hostile_tree(tmp_path)
    (src / "locked").mkdir()
    (src / "locked" / "in.jpg").write_bytes(_photo())
    (src / "locked").chmod(0)
    out = tmp_path / "out"
    try:
        run = subprocess.run(_unprivileged() + BC + ["run", str(src), "--output", str(out), "--shard-size", "8"],
                             capture_output=True, text=True, cwd=REPO, timeout=400)
    finally:
        (src / "locked").chmod(0o755)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "\x1b]" not in run.stdout + run.stderr
    files, errors = _expected(src, follow=False)
    errors[_uri(src / "locked", folder=True)] = "Permission denied"
    rows = _rows(out)
    assert sorted(r["uri"] for r in rows) == sorted(files | set(errors))  # once each
    by_uri = {r["uri"]: r for r in rows}
    assert all(by_uri[u]["status"] == "ok" for u in files), [by_uri[u] for u in files if by_uri[u]["status"] != "ok"]
    for uri, words in errors.items():
        assert by_uri[uri]["status"] == "error" and by_uri[uri]["error"].startswith("list_error: "), by_uri[uri]
        assert words in by_uri[uri]["error"]
    success = json.loads((out / "_SUCCESS").read_text())
    assert success["list_errors"] == len(errors) and success["rows"] == len(files) + len(errors)
    assert f"{len(files) + len(errors)} rows" in run.stdout
    report = subprocess.run(BC + ["report", str(out)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert report.returncode == 0 and "not listed" in report.stdout and "list_error" in report.stdout


def _legacy_copy(out: Path, legacy: Path) -> int:
    """``out`` rewritten as today's release wrote it: ``file://`` + the raw path; the rows whose URI changed."""
    from pipeline.schema import REPORT, RUN_INFO, SUCCESS
    from pipeline.io.reader import committed_parts
    from pipeline.io.writer import write_shard

    from pipeline.storage import open_fs

    fs, root = open_fs(str(out))
    changed = 0
    for part in committed_parts(fs, root):
        table = pads.dataset(part, format="parquet").to_table()
        uris = table.column("uri").to_pylist()
        old = [legacy_uri(u) or u for u in uris]
        changed += sum(a != b for a, b in zip(uris, old))
        table = table.set_column(table.schema.get_field_index("uri"), "uri", pa.array(old, pa.string()))
        write_shard(table.replace_schema_metadata(None), output=str(legacy), storage_options={})
    for name in (RUN_INFO, SUCCESS, REPORT):
        shutil.copy(out / name, legacy / name)
    return changed


def test_outputs_with_todays_raw_uris_resume_and_carry_over(tmp_path, ray_local):
    from pipeline.config import RunConfig
    from pipeline.job import run_job

    src = tmp_path / "src"
    src.mkdir()
    names = ODD_NAMES[:6] + ["p1.jpg", "p2.jpg", "p3.jpg"]
    for i, name in enumerate(names):
        (src / name).write_bytes(_photo(["astronaut", "coffee", "camera"][i % 3]))
    out, legacy = tmp_path / "out", tmp_path / "legacy"
    run_job(RunConfig(source=str(src), output=str(out), shard_size=4))
    odd = _legacy_copy(out, legacy)
    assert odd == 6 and any("#" in r["uri"] for r in _rows(legacy))

    resumed = run_job(RunConfig(source=str(src), output=str(legacy), shard_size=4))
    assert resumed.classified == 0 and resumed.already_done == len(names) and resumed.total == len(names)
    assert len(_rows(legacy)) == len(names)

    day2 = tmp_path / "day2"
    carried = run_job(RunConfig(source=str(src), output=str(day2), previous=str(legacy), shard_size=4))
    rows = _rows(day2)
    assert sorted(r["uri"] for r in rows) == sorted(_uri(src / n) for n in names)  # today's form, once each
    assert carried.carried == 3 and carried.classified == 6  # the renamed ones are classified again, once
    assert all(r["status"] == "ok" for r in rows)


S3_KEYS = ["k/a#b.jpg", "k/q?x=1.jpg", "k/%20.jpg", "k/sp ace.jpg", "k/caf\u00e9.jpg", "k/1+1.jpg", "k//double.jpg",
           "k/../up.jpg", "k/100%.jpg", "k/plain.jpg"]


def test_s3_odd_keys_get_uris_that_parse_back_and_fetch_the_right_bytes(s3, s3_server):
    from pipeline.config import DEFAULT_EXTENSIONS
    from pipeline.io.fetch import fetch_batch
    from pipeline.columns import conform
    from pipeline.schema import DATA, WORK_SCHEMA
    from pipeline.io.source import entries_table, list_unit, plan_listing
    from pipeline.storage import open_fs

    s3.create_bucket(Bucket="hostile-keys")
    bodies = {key: f"body of {key}".encode() for key in S3_KEYS}
    for key, body in bodies.items():
        s3.put_object(Bucket="hostile-keys", Key=key, Body=body)
    fs, root = open_fs("s3://hostile-keys/k")
    entries = [e for g in plan_listing(fs, root, DEFAULT_EXTENSIONS, 2) for u in g
               for e in list_unit(fs, u, DEFAULT_EXTENSIONS)]
    uris = [e[0] for e in entries]
    assert len(uris) == len(S3_KEYS) == len(set(uris))
    for uri in uris:
        parts = urllib.parse.urlsplit(uri)
        assert (parts.scheme, parts.netloc, parts.query, parts.fragment) == ("s3", "hostile-keys", "", "")
        assert urllib.parse.unquote(parts.path)[1:] in bodies and uri_path(uri) == urllib.parse.unquote(uri[5:])
    batch = fetch_batch(conform(entries_table(entries), WORK_SCHEMA), source="s3://hostile-keys/k",
                        storage_options={}, threads=4, max_bytes=1 << 20, retries=0)
    fetched = dict(zip(batch.column("uri").to_pylist(), batch.column(DATA).to_pylist()))
    assert {urllib.parse.unquote(u[len("s3://hostile-keys/"):]): data for u, data in fetched.items()} == bodies


def test_s3_prefix_without_images_is_refused_before_any_work(s3, s3_server):
    from pipeline.errors import EmptySourceError
    from pipeline.io.source import check_source
    from pipeline.storage import open_fs

    s3.create_bucket(Bucket="hostile-empty")
    s3.put_object(Bucket="hostile-empty", Key="p/notes.txt", Body=b"no")
    s3.put_object(Bucket="hostile-empty", Key="q/deep/x.jpg", Body=b"x")
    fs, root = open_fs("s3://hostile-empty/p")
    with pytest.raises(EmptySourceError, match=r"^source 's3://hostile-empty/p' holds no file with extension jpg"):
        check_source(fs, root, "s3://hostile-empty/p", ("jpg",))
    fs, root = open_fs("s3://hostile-empty/q")
    check_source(fs, root, "s3://hostile-empty/q", ("jpg",))  # one image, deeper down: not empty


CLI = [sys.executable, "-m", "pipeline.cli"]


def bulk(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600
         ) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=dict(os.environ, **(env or {})))


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` with its bytes (None for folders): DEST or SOURCE byte for byte."""
    if not folder.exists():
        return {}
    def content(p: Path) -> bytes | None:
        if p.is_symlink():
            return b"-> " + os.readlink(p).encode()
        return None if p.is_dir() else p.read_bytes()

    return {str(p.relative_to(folder)): content(p) for p in sorted(folder.rglob("*"))}


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The run failed with exactly one line on stderr (click's 'Error: ...'), no traceback; that line."""
    assert result.returncode != 0, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr[-3000:]
    return lines[0]


def rows_of(dest: Path) -> list[dict]:
    parts = [str(p) for p in sorted(dest.rglob("part-*.parquet"))]
    return pads.dataset(parts, format="parquet").to_table().to_pylist() if parts else []


def assert_one_row_per_input(dest: Path, names: set[str]) -> None:
    uris = [r["uri"] for r in rows_of(dest)]
    assert len(uris) == len(set(uris)), "a URI has two rows"
    assert {u.rsplit("/", 1)[-1] for u in uris} == names
    success = json.loads((dest / SUCCESS).read_text())
    assert success["rows"] == len(names)


def images(folder: Path, n: int, start: int = 0) -> set[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + n):
        (folder / f"img{i:04d}.jpg").write_bytes(make_jpeg(i, (24, 20)))
    return {f"img{i:04d}.jpg" for i in range(start, start + n)}


@pytest.fixture(scope="module")
def complete(tmp_path_factory, ray_local):
    """A complete output of the photos, written by a real run: (source, DEST) to copy."""
    base = tmp_path_factory.mktemp("complete")
    src, out = base / "src", base / "out"
    shutil.copytree(PHOTOS, src)
    run_job(RunConfig(source=str(src), output=str(out), shard_size=4, batch_size=4))
    assert (out / SUCCESS).exists()
    return src, out


# ---- output side: identity, --overwrite, one run at a time, checks before changes, storage failures ----


def _camera(tmp_path: Path) -> Path:
    """Reproduction 1's source: images named like shards, one in a two-hex-digit folder."""
    cam = tmp_path / "cam"
    (cam / "0a").mkdir(parents=True)
    for i in (1, 2, 3):
        shutil.copy(PHOTOS / "astronaut.jpg", cam / f"part-000{i}.jpg")
    shutil.copy(PHOTOS / "camera.jpg", cam / "0a" / "part-a.jpg")
    shutil.copy(PHOTOS / "coffee.jpg", cam / "keep.jpg")
    return cam


@pytest.mark.parametrize("spelling", ["./cam", "{pwd}/cam", "file://{pwd}/cam", "cam/.", "cam/0a/..", "link",
                                      ".", "{pwd}"])
def test_output_that_is_or_holds_the_source_is_refused_however_spelled(tmp_path, spelling):
    cam = _camera(tmp_path)
    (tmp_path / "link").symlink_to(cam)
    before, here = snapshot(cam), snapshot(tmp_path)
    result = bulk("run", "cam", "--output", spelling.format(pwd=tmp_path), "--overwrite", cwd=tmp_path)
    line = one_line_error(result)
    assert "SOURCE" in line and ("choose an --output outside the source folder" in line or "must differ" in line)
    assert snapshot(cam) == before and snapshot(tmp_path) == here


def test_output_inside_the_source_is_allowed_and_never_listed(tmp_path, ray_local):
    src = tmp_path / "src"
    names = images(src, 5)
    out = src / "results"
    # parquet and json listed as inputs would make the output's own files rows of the next run
    config = RunConfig(source=str(src), output=str(out), extensions=("jpg", "parquet", "json"), shard_size=2)
    first = run_job(config)
    assert first.total == 5
    second = run_job(config)
    assert second.classified == 0 and second.total == 5
    assert_one_row_per_input(out, names)


def test_overwrite_deletes_only_the_shards_and_files_this_tool_committed(tmp_path, complete):
    _src, done = complete
    out = tmp_path / "out"
    shutil.copytree(done, out)
    ours = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    group = next(p for p in out.iterdir() if p.is_dir())
    foreign = {
        "part-0001.jpg": (PHOTOS / "astronaut.jpg").read_bytes(),
        f"{group.name}/part-a.jpg": (PHOTOS / "camera.jpg").read_bytes(),
        "0b/part-b.parquet": b"PAR1 not ours",
        "keep.jpg": (PHOTOS / "coffee.jpg").read_bytes(),
        "_SUCCESS.txt": b"spark's",
        "notes/_RUN.json": b"{}",
    }
    table = pa.table({"x": [1, 2]})
    import pyarrow.parquet as pq

    (out / "0b").mkdir()
    (out / "notes").mkdir()
    for name, data in foreign.items():
        (out / name).write_bytes(data)
    pq.write_table(table, out / "0b" / "part-0123456789abcdef01234567.parquet")  # Parquet, but no commit record
    (out / "_REPORT.json").write_text('{"a user": "file"}')  # our name, not our content
    ours.discard("_REPORT.json")
    keep = snapshot(out)
    fs, root = open_fs(str(out))
    remove_owned(fs, root)
    after = snapshot(out)
    assert not any(name in after for name in ours)
    assert {k: v for k, v in keep.items() if k not in ours and v is not None} == \
        {k: v for k, v in after.items() if v is not None}


@pytest.mark.parametrize("args", [["--top-k", "3"], ["--previous", "/typo"], ["--model", "/nonexistent"],
                                  ["--overwrite", "--model", "badmodel"], ["--engine-option", "nope=1"]])
def test_a_refused_run_leaves_a_complete_output_exactly_as_it_was(tmp_path, complete, args):
    src, done = complete
    out = tmp_path / "out"
    shutil.copytree(done, out)
    before, source = snapshot(out), snapshot(src)
    one_line_error(bulk("run", str(src), "--output", str(out), *args, cwd=tmp_path))
    assert snapshot(out) == before and snapshot(src) == source


def test_missing_output_bucket_fails_in_one_line_and_creates_none(s3_server, s3):
    before = sorted(b["Name"] for b in s3.list_buckets()["Buckets"])
    line = one_line_error(bulk("run", str(PHOTOS), "--output", "s3://no-such-bucket/x"))
    assert "bucket 'no-such-bucket' does not exist" in line
    assert sorted(b["Name"] for b in s3.list_buckets()["Buckets"]) == before


def _race(make_lease, n: int = 8) -> tuple[list, list]:
    """``n`` leases taken at the same moment from threads; (the ones that got it, the refusals)."""
    barrier, won, refused = threading.Barrier(n), [], []

    def take() -> None:
        lease = make_lease()
        barrier.wait()
        try:
            won.append(lease.acquire())
        except LeaseHeld as err:
            refused.append(str(err))

    threads = [threading.Thread(target=take) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, refused


def _stale(path_write, pid: int, age_s: float) -> None:
    started = datetime.now(timezone.utc).isoformat()  # after the holder process started: not a reused pid
    path_write(json.dumps({"host": socket.gethostname(), "pid": pid, "started_at": started,
                           "renewed_at": time.time() - age_s, "ttl_s": 120.0, "token": uuid.uuid4().hex}).encode())


@pytest.mark.parametrize("store", ["local", "s3"])
def test_lease_is_atomic_names_its_holder_and_is_taken_over_when_stale(tmp_path, store, request):
    if store == "s3":
        request.getfixturevalue("s3_server")
        s3 = request.getfixturevalue("s3")
        bucket = f"lease-{uuid.uuid4().hex[:8]}"
        s3.create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/out"
    else:
        url = str(tmp_path / "out")
        (tmp_path / "out").mkdir()
    fs, root = open_fs(url)
    won, refused = _race(lambda: Lease(fs, root, url))
    assert len(won) == 1 and len(refused) == 7
    assert all(f"pid {os.getpid()} on {socket.gethostname()}" in r and LEASE in r for r in refused), refused
    won[0].release()
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/{LEASE}")

    def write(data: bytes) -> None:
        fs.pipe_file(f"{root}/{LEASE}", data)

    _stale(write, os.getppid(), age_s=1)  # a live holder, renewed a second ago: refused
    with pytest.raises(LeaseHeld, match=f"pid {os.getppid()} on "):
        Lease(fs, root, url).acquire()
    _stale(write, os.getppid(), age_s=600)  # not renewed for 10 minutes: expired, taken over by exactly one
    won, refused = _race(lambda: Lease(fs, root, url))
    assert len(won) == 1 and len(refused) == 7
    holder = json.loads(fs.cat_file(f"{root}/{LEASE}"))
    assert holder["token"] == won[0].token and holder["pid"] == os.getpid()
    won[0].renew()
    assert not won[0].lost
    won[0].release()
    if store == "local":
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        _stale(write, dead.pid, age_s=1)  # renewed just now, but its process on this host is gone (kill -9)
        Lease(fs, root, url).acquire().release()


def test_two_runs_into_one_output_one_runs_the_other_refuses_naming_it(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    names = images(src, 40)
    first = subprocess.Popen(CLI + ["run", str(src), "--output", str(out), "--quiet", "--shard-size", "10"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / LEASE).exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    holder = json.loads((out / LEASE).read_text())
    second = bulk("run", str(src), "--output", str(out), "--shard-size", "16", "--batch-size", "8")
    line = one_line_error(second)
    assert f"in use by another run: pid {holder['pid']} on {holder['host']}" in line and LEASE in line
    _stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr[-3000:]
    assert_one_row_per_input(out, names)
    assert not (out / LEASE).exists()


def test_rows_two_runs_wrote_anyway_end_as_one_row_per_input(tmp_path, complete, ray_local):
    src, done = complete
    out = tmp_path / "out"
    shutil.copytree(done, out)
    fs, root = open_fs(str(out))
    rows = pads.dataset(committed_parts(fs, root), format="parquet").to_table()
    # a second run with other shard and batch sizes, that the lease did not stop (another host's clock, a bug):
    # the same rows committed again in shards of 3
    for start in range(0, rows.num_rows, 3):
        write_shard(conform(rows.slice(start, 3), OUTPUT_SCHEMA), output=str(out), storage_options={})
    assert len(rows_of(out)) == 2 * rows.num_rows
    summary = run_job(RunConfig(source=str(src), output=str(out), shard_size=5))
    assert summary.classified == 0 and summary.total == rows.num_rows
    assert_one_row_per_input(out, {p.name for p in src.glob("*.jpg")})
    assert dedupe_output(fs, root, str(out)) == 0


def test_an_output_of_todays_release_still_resumes(tmp_path, ray_local):
    """Shards as today's release commits them: ``file://`` + the path as listed, the version-2 record."""
    src, out = tmp_path / "src", tmp_path / "out"
    names = images(src, 6)
    half = sorted(names)[:3]
    stamp = pa.scalar(0, pa.timestamp("us", tz="UTC"))
    table = pa.table({
        "uri": [f"file://{src}/{n}" for n in half], "status": ["ok"] * 3, "error": [None] * 3,
        "class_ids": [[1]] * 3, "labels": [["goldfish"]] * 3, "scores": [[0.9]] * 3,
        "model": ["efficientnet-lite0"] * 3, "engine": ["onnx"] * 3,
        "size_bytes": [(src / n).stat().st_size for n in half], "width": [24] * 3, "height": [20] * 3,
        "etag": [None] * 3, "mtime": [stamp] * 3, "classified_at": [stamp] * 3, "carried": [False] * 3,
    })
    write_shard(conform(table, OUTPUT_SCHEMA), output=str(out), storage_options={})
    fs, root = open_fs(str(out))
    write_json(fs, root, "_RUN.json", {"model": "efficientnet-lite0", "top_k": 1, "engine": "onnx",
                                       "started_at": "2026-12-01T00:00:00+00:00"})
    summary = run_job(RunConfig(source=str(src), output=str(out), top_k=1))
    assert summary.already_done == 3 and summary.classified == 3
    assert_one_row_per_input(out, names)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (as root); skipped where mounting is not permitted."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path, leave_bytes: int) -> Path:
    """Fill ``disk`` up to ``leave_bytes`` free; the filler file, to delete to free the space again."""
    filler = disk / "filler"
    free = shutil.disk_usage(disk).free
    try:
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, free - leave_bytes))
    except OSError:
        pass  # full to the last page
    return filler


def test_full_disk_before_new_work_keeps_a_complete_output_complete(tmp_path, complete, small_disk):
    src, done = complete
    out = small_disk / "out"
    shutil.copytree(done, out)
    _fill(small_disk, 0)
    before = snapshot(out)
    line = one_line_error(bulk("run", str(src), "--output", str(out), cwd=tmp_path))
    assert f"cannot write --output {str(out)!r}: [Errno 28] No space left on device" in line
    assert snapshot(out) == before  # _SUCCESS included: still complete


def test_full_disk_mid_run_gives_one_line_leaves_no_temporary_files_and_resumes(tmp_path, small_disk, ray_local):
    src, out = tmp_path / "src", small_disk / "out"
    names = images(src, 12)
    filler = _fill(small_disk, 24 * 1024)  # room for the lease and _RUN.json, not for every shard
    failed = bulk("run", str(src), "--output", str(out), "--shard-size", "1", "--batch-size", "2")
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    # Ray Data logs its own two ERROR lines before the job's; the job's is the last one
    assert failed.stderr.strip().splitlines()[-1].startswith(
        f"Error: cannot write --output {str(out)!r}: [Errno 28] No space left on device; free space there"), \
        failed.stderr[-3000:]
    assert not [p for p in out.rglob(".*") if p.name.endswith(".tmp")]
    assert not (out / SUCCESS).exists() and not (out / LEASE).exists()
    filler.unlink()
    run_job(RunConfig(source=str(src), output=str(out), shard_size=1, batch_size=2))
    assert_one_row_per_input(out, names)


# ---- Ray and its processes: loopback only, nothing left behind, bounds, a lost node ----



def write_images(folder: Path, n: int, seed: int = 0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"img{i:04d}.jpg"
        path.write_bytes(make_jpeg(seed + i))
        paths.append(path)
    return paths


def rows(output: Path) -> list[dict]:
    return pads.dataset(str(output), format="parquet").to_table(columns=["uri", "status"]).to_pylist()


def cli_env() -> dict[str, str]:
    """The environment of a run as a user starts it: a local Ray of its own, none of this session's settings."""
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "RAY_enable_metrics_collection", "RAY_enable_open_telemetry",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(key, None)
    return env


# ---- the Ray/process side: loopback only, nothing left behind, bounds, a lost node -----------------------------

LOOPBACK_IPS = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def listeners(procs) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``procs``."""
    import psutil

    found = set()
    for proc in procs:
        try:
            name = proc.name()
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((name, conn.laddr.ip, conn.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def session_processes(session: str) -> list:
    """The live processes whose command line names Ray session folder ``session``, and their children."""
    import psutil

    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if session in " ".join(proc.info["cmdline"] or []):
                found[proc.pid] = proc
                found.update({c.pid: c for c in proc.children(recursive=True)})
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [p for p in found.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def ray_session_of(pid: int) -> str | None:
    """The Ray session folder that the local Ray of driver ``pid`` runs in, once its raylet is up."""
    import re

    from pipeline.job.local_ray import SESSION_DIR

    for proc in tree(pid):
        try:
            if "raylet" in proc.name():
                found = SESSION_DIR.search(" ".join(proc.cmdline()))
                if found and re.search(rf"_{pid}$", found.group(0)):
                    return found.group(0)
        except Exception:  # noqa: BLE001 - a process that just ended
            continue
    return None


def owned_folders(pids) -> list[Path]:
    """The engine repositories and Triton work folders of processes ``pids`` under the temp folder."""
    from pipeline.triton.workdirs import REPOSITORY_PREFIX, WORKDIR_PREFIX

    tmp = Path(tempfile.gettempdir())
    return [p for prefix in (REPOSITORY_PREFIX, WORKDIR_PREFIX) for pid in pids
            for p in tmp.glob(f"{prefix}{pid}-*")]


def test_only_temp_folders_of_dead_owners_are_swept(tmp_path):
    """The sweep removes this user's ``<prefix><pid>-*`` folders whose pid is gone, and nothing else: not a live
    owner's, not a name without a pid, not a file."""
    from pipeline.triton.workdirs import WORKDIR_PREFIX, owned_temp_folder, sweep_dead_owner_folders

    gone = subprocess.Popen(["true"])
    gone.wait()
    tmp = Path(tempfile.gettempdir())
    dead = tmp / f"{WORKDIR_PREFIX}{gone.pid}-hostile"
    (dead / "backends").mkdir(parents=True)
    (dead / "tritonserver.log").write_text("left by a SIGKILLed actor")
    live = owned_temp_folder(WORKDIR_PREFIX)
    unnamed = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}x"))
    stray_file = tmp / f"{WORKDIR_PREFIX}{gone.pid}-file"
    stray_file.write_text("not a folder")
    try:
        removed = sweep_dead_owner_folders(WORKDIR_PREFIX)
        assert dead.name in removed and not dead.exists()
        assert live.exists() and unnamed.exists() and stray_file.exists()
        assert live.name not in removed
    finally:
        for path in (dead, live, unnamed):
            shutil.rmtree(path, ignore_errors=True)
        stray_file.unlink(missing_ok=True)


def test_a_default_run_listens_on_loopback_only(tmp_path):
    """Reproduction 6: every listening socket of the job's process tree (driver, GCS, raylet, agents, workers,
    autoscaler and dashboard metrics) is on 127.0.0.1 or ::1, sampled while the run lives."""
    src = tmp_path / "src"
    write_images(src, 40)
    out = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "run", str(src), "--output", str(out), "-q"], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[tuple[str, str, int]] = set()
    while proc.poll() is None:
        seen |= listeners(tree(proc.pid))
        time.sleep(0.5)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr
    assert len(rows(out)) == 40
    names = {name for name, _ip, _port in seen}
    # The sampling saw Ray's servers, or it proves nothing.
    assert {"gcs_server", "raylet"} <= names, seen
    assert any(name.startswith("ray::") for name in names), seen
    wide = sorted(s for s in seen if s[1] not in LOOPBACK_IPS)
    assert not wide, f"listening beyond loopback: {wide}"


def mark_as_dead_run(cluster) -> None:
    """Give a running ``ray start`` cluster the owner mark of a bulk-classify driver that has died: real Ray
    processes that outlived their driver, as a driver killed with SIGKILL can leave them."""
    import json

    from pipeline.job.local_ray import OWNER_FILE

    gone = subprocess.Popen(["true"])
    gone.wait()
    session = Path(cluster.temp_dir, "session_latest").resolve()
    (session / OWNER_FILE).write_text(json.dumps({"pid": gone.pid, "started": 0.0}))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_after_kill_9_of_the_driver_the_next_run_starts_clean(tmp_path, ray_cluster):
    """Reproduction 6: a driver killed with SIGKILL mid-run (Triton engine) leaves its Triton folders, and can leave
    its Ray's agents running; the next run ends those processes and removes those folders before its own Ray starts,
    and touches no process or folder of a live owner (``ray_cluster``: a live cluster without our mark)."""
    from pipeline.triton.workdirs import REPOSITORY_PREFIX, owned_temp_folder

    src = tmp_path / "src"
    write_images(src, 200)
    live_folder = owned_temp_folder(REPOSITORY_PREFIX)  # ours, alive: must survive the sweep
    doomed = LocalRayCluster()
    victim = subprocess.Popen([*CLI, "run", str(src), "--output", str(tmp_path / "out1"), "-q",
                               "--engine", "triton", "--batch-size", "8"], env=cli_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        session, folders = None, []
        while time.time() < deadline and victim.poll() is None:
            session = session or ray_session_of(victim.pid)
            folders = owned_folders([p.pid for p in tree(victim.pid)])
            if session and folders:  # its server's work folder (the repository is the cached one)
                break
            time.sleep(1)
        assert victim.poll() is None and session and folders, "the run ended or never started Triton"
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        try:
            doomed.start()
        except subprocess.CalledProcessError as err:  # a loaded machine: ray start's raylet missed its 30 s
            pytest.fail(f"ray start failed: {err.stderr[-1500:]}")
        mark_as_dead_run(doomed)
        assert doomed.processes() and all(f.exists() for f in folders)  # what the next run must clean up
        bystanders = ray_cluster.processes()
        assert bystanders

        nxt = subprocess.Popen([*CLI, "run", str(src), "--output", str(tmp_path / "out2"), "-q"], env=cli_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The sweep runs before the next run's own Ray starts: by the time its raylet is up, nothing is left.
        deadline = time.time() + 300
        while nxt.poll() is None and ray_session_of(nxt.pid) is None and time.time() < deadline:
            time.sleep(0.5)
        left = [(p.pid, p.name()) for p in session_processes(session) + doomed.processes()]
        gone = [f for f in folders if f.exists()]
        _out, err = nxt.communicate(timeout=600)
        assert nxt.returncode == 0, err
        assert not left, f"processes of dead runs still alive: {left}"
        assert not gone, f"folders of the killed run still there: {gone}"
        assert live_folder.exists(), "a folder of a live owner was removed"
        assert all(p.is_running() for p in bystanders), "a process of a live cluster was ended"
        assert len(rows(tmp_path / "out2")) == 200
    finally:
        if victim.poll() is None:
            victim.kill()
        doomed.stop()
        shutil.rmtree(live_folder, ignore_errors=True)


@pytest.mark.slow
def test_a_triton_run_leaves_no_temp_folders(tmp_path):
    """Reproduction 6: ``--engine triton`` ends with its engines' repositories and server folders removed."""
    src = tmp_path / "src"
    write_images(src, 30)
    out = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "run", str(src), "--output", str(out), "-q", "--engine", "triton"],
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: set[int] = set()
    while proc.poll() is None:
        pids |= {p.pid for p in tree(proc.pid)}
        time.sleep(0.5)
    _out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert len(rows(out)) == 30
    assert len(pids) > 3  # the driver, Ray's daemons and the classify actor were seen
    assert not owned_folders(pids), owned_folders(pids)


def test_more_actors_than_the_cluster_holds_are_clamped_with_a_warning():
    """Reproduction 8, the plan: on 2 CPUs at most 5 classify actors of 0.25 CPU fit beside the listing, fetch and
    write tasks; on 2 GPUs at most 2 actors of one GPU each."""
    from pipeline.config import RunConfig
    from pipeline.job.stages import IO_TASK_CPUS, actor_plan

    actors, actor_cpus, gpus = actor_plan(RunConfig(source="/s", output="/o", num_actors=8), 2, 0)
    assert (actors, actor_cpus, gpus) == (5, 0.25, 0.0)
    assert actors * actor_cpus + 3 * IO_TASK_CPUS <= 2
    assert actor_plan(RunConfig(source="/s", output="/o", num_actors=3), 8, 0)[0] == 3  # fits: unchanged
    assert actor_plan(RunConfig(source="/s", output="/o", num_actors=4, num_gpus_per_actor=1.0), 16, 2)[0] == 2


@pytest.mark.timeout(900)
def test_num_actors_8_on_2_cpus_answers_instead_of_hanging(ray_local, tmp_path, caplog):
    """Reproduction 8: ``--num-actors 8`` on a 2-CPU Ray finishes every row, with one warning naming the clamp."""
    from pipeline.config import RunConfig
    from pipeline.job import run_job

    src = tmp_path / "src"
    write_images(src, 24)
    with caplog.at_level(logging.WARNING, logger="pipeline.job.stages"):
        summary = run_job(RunConfig(source=str(src), output=str(tmp_path / "out"), num_actors=8, batch_size=4))
    assert summary.total == 24 and len(rows(tmp_path / "out")) == 24
    warned = [r.getMessage() for r in caplog.records if "--num-actors 8" in r.getMessage()]
    assert warned == ["--num-actors 8: this Ray cluster (2 CPUs, 0 GPUs) holds at most 5 classify actors beside the "
                      "listing, fetch and write tasks; running 5"]


def _raylet_children(node) -> list:
    """The processes under a ``ray.cluster_utils`` node's raylet (its workers and agents)."""
    from ray._private import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    return tree(raylet.pid)[1:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_worker_node_lost_mid_run_leaves_every_input_exactly_once(tmp_path):
    """A lost node (spot preemption): a local cluster of a head and two worker raylets (``ray.cluster_utils``); the
    worker running a classify actor is killed once shards are committed. The run finishes, or fails and a rerun
    resumes; at the end every input has exactly one row."""
    from ray.cluster_utils import Cluster

    n = 480
    src = tmp_path / "src"
    names = sorted(p.name for p in write_images(src, n))
    out = tmp_path / "out"
    loopback = {"node_ip_address": "127.0.0.1", "object_store_memory": 150 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **loopback})
    try:
        workers = [cluster.add_node(num_cpus=2, **loopback) for _ in range(2)]
        # The driver joins the cluster as a client; Ray's loopback switch makes it find its raylet on 127.0.0.1.
        env = dict(cli_env(), RAY_ADDRESS=cluster.address, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        cmd = [*CLI, "run", str(src), "--output", str(out), "-q", "--num-actors", "2", "--batch-size", "8",
               "--shard-size", "16"]
        first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 900
        victim, seen_at = None, None
        while first.poll() is None and time.time() < deadline:
            victim = victim or next((w for w in workers if any("ClassifyActor" in " ".join(p.cmdline())
                                                               for p in _raylet_children(w))), None)
            seen_at = seen_at or (time.time() if victim is not None else None)
            # Lost while classifying: once a shard is committed, or a few seconds into the actor's work.
            if victim is not None and (list(out.glob("*/part-*.parquet")) or time.time() - seen_at > 5):
                break
            time.sleep(0.2)
        assert first.poll() is None and victim is not None, "the run ended before a node could be lost"
        committed_before = len(list(out.glob("*/part-*.parquet")))
        assert committed_before < n // 16, "every shard was committed before the node was lost"
        cluster.remove_node(victim, allow_graceful=False)
        _out, err = first.communicate(timeout=900)
        first_err = err.strip().splitlines()[-1:] if err.strip() else []
        outcomes = [first.returncode]
        while outcomes[-1] != 0 and len(outcomes) < 3:  # failed: resume, as a user (or the nightly) would
            again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            outcomes.append(again.returncode)
            err = again.stderr
        assert outcomes[-1] == 0, f"runs exited {outcomes}; last stderr: {err[-2000:]}"
        print(f"lost a node after {committed_before} shard(s); the runs exited {outcomes}; {first_err}")  # with -s
        got = rows(out)
        uris = [r["uri"] for r in got]
        assert len(uris) == len(set(uris)) == n, f"{len(uris)} rows, {len(set(uris))} distinct, after runs {outcomes}"
        assert sorted(u.rsplit("/", 1)[-1] for u in uris) == names
        assert {r["status"] for r in got} == {"ok"}
    finally:
        cluster.shutdown()
