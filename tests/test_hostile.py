"""Hostile but ordinary use (issue 22): each reproduction gives the right rows, or one line and DEST as it was."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from conftest import PHOTOS, make_jpeg
from pipeline.config import RunConfig
from pipeline.job import run_job
from pipeline.job.lease import Lease, LeaseHeld
from pipeline.job.output import dedupe_output, remove_owned
from pipeline.schema import LEASE, OUTPUT_SCHEMA, SUCCESS, conform
from pipeline.source import open_fs
from pipeline.writer import committed_parts, write_json, write_shard

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
    assert dedupe_output(RunConfig(source=str(src), output=str(out)), fs, root) == 0


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
