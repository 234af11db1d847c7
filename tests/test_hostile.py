"""Hostile but ordinary inputs (issue 22's reproductions): each gives the right rows, or one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from pipeline.keys import legacy_uri, uri_path

REPO = Path(__file__).resolve().parents[1]
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
    from pipeline.source import list_unit, open_fs, plan_listing

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
    from pipeline.keys import uri_hashes
    from pipeline.source import listing_blocks, open_fs, plan_listing

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
        script = ("import json, sys; from pipeline.source import list_unit, open_fs, plan_listing; "
                  "fs, root = open_fs(sys.argv[1]); ext = ('jpg',); "
                  "print(json.dumps([[list(e) for g in plan_listing(fs, root, ext, 2) for u in g "
                  "for e in list_unit(fs, u, ext)], [list(e) for e in list_unit(fs, ('fs_dir', root), ext)]]))")
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
    from pipeline.imaging import DecodeLimits, decode_image

    buf = io.BytesIO()
    Image.new("RGB", (200, 100), (9, 9, 9)).save(buf, format="PNG")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5_000)  # Pillow alone refuses 20,000 pixels (over twice this)
    assert decode_image(buf.getvalue(), DecodeLimits(max_pixels=30_000)).size == (200, 100)
    assert Image.MAX_IMAGE_PIXELS == 30_000
    with pytest.raises(ImageError, match=r"^too_many_pixels: 200x100 = 20000 pixels is over max_pixels=10000"):
        decode_image(buf.getvalue(), DecodeLimits(max_pixels=10_000))


def test_report_escapes_control_characters_of_labels_and_paths(tmp_path):
    from datetime import datetime, timezone

    from pipeline.schema import OUTPUT_SCHEMA, conform
    from pipeline.writer import write_shard

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
    from pipeline.writer import committed_parts, write_shard

    from pipeline.source import open_fs

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
    from pipeline.fetch import fetch_batch
    from pipeline.schema import DATA, WORK_SCHEMA, conform
    from pipeline.source import entries_table, list_unit, open_fs, plan_listing

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
    from pipeline.source import check_source, open_fs

    s3.create_bucket(Bucket="hostile-empty")
    s3.put_object(Bucket="hostile-empty", Key="p/notes.txt", Body=b"no")
    s3.put_object(Bucket="hostile-empty", Key="q/deep/x.jpg", Body=b"x")
    fs, root = open_fs("s3://hostile-empty/p")
    with pytest.raises(EmptySourceError, match=r"^source 's3://hostile-empty/p' holds no file with extension jpg"):
        check_source(fs, root, "s3://hostile-empty/p", ("jpg",))
    fs, root = open_fs("s3://hostile-empty/q")
    check_source(fs, root, "s3://hostile-empty/q", ("jpg",))  # one image, deeper down: not empty
