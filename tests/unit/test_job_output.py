"""Fast unit tests of pipeline.job.output: DEST preparation and the resume/carry sets from shard records (no Ray)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from pipeline.columns import conform
from pipeline.errors import OutputError
from pipeline.io.keys import uri_hash
from pipeline.io.reader import committed_parts
from pipeline.io.writer import write_shard
from pipeline.job.output import (
    RecordCounter, begin_output, check_output, index_output, open_store, read_previous,
)
from pipeline.quality.statistics import committed_quality
from pipeline.schema import OUTPUT_SCHEMA
from pipeline.storage import open_fs
from test_writer import M_DIGEST, rows

M = SimpleNamespace(name="m", digest=M_DIGEST, short_digest=M_DIGEST[:12])  # the model that wrote ``rows``


def test_index_reads_counts_and_sorted_hashes_from_records_without_ray(tmp_path):
    write_shard(rows(10, errors=3), output=str(tmp_path), storage_options={})
    write_shard(rows(5, 10), output=str(tmp_path), storage_options={})
    pq.write_table(conform(rows(2, 50), OUTPUT_SCHEMA), tmp_path / "part-flat.parquet")  # an older, flat shard
    fs, root = open_fs(str(tmp_path))
    index = index_output(fs, root, carry_model=M, carry_top_k=2)
    assert len(index.parts) == 3 and index.counts == {"ok": 14, "error": 3} and index.rows == 17
    expect = sorted(uri_hash(f"file:///src/img{i:06d}.jpg") for i in list(range(15)) + [50, 51])
    assert index.uri_hashes.tolist() == expect and index.uri_hashes.dtype.name == "int64"
    assert index.identities.size == 14  # ok rows only: error rows are retried, never carried
    retrained = SimpleNamespace(name="m", digest="e" * 64)  # same name, other files: nothing carried
    assert index_output(fs, root, carry_model=retrained, carry_top_k=2).identities.size == 0
    renamed = SimpleNamespace(name="elsewhere", digest=M_DIGEST)  # same files in another folder: carried
    assert index_output(fs, root, carry_model=renamed, carry_top_k=2).identities.size == 14
    assert index_output(fs, root, carry_model=M, carry_top_k=5).identities.size == 0
    assert index_output(fs, root, hashes=False).counts == {"ok": 14, "error": 3}  # the counts alone, no hashes
    counter = RecordCounter(fs)  # the job's final counts, from the footers its quality pass reads anyway
    assert committed_quality(fs, root, on_footer=counter)["rows"] == 17 and counter.counts == {"ok": 14, "error": 3}


def test_the_job_library_below_the_ray_stages_imports_no_ray():
    code = "import sys, pipeline.job, pipeline.job.output, pipeline.io.writer, pipeline.io.reader, pipeline.io.source; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_previous_without_shards_says_how_to_fix(tmp_path):
    previous = open_store(str(tmp_path / "none"), {})
    with pytest.raises(OutputError, match="holds no committed output; drop the option or fix the URL"):
        read_previous(previous, M, 2)


def test_begin_output_overwrite_removes_only_this_tools_files(tmp_path):
    out = tmp_path / "out"
    write_shard(rows(4), output=str(out), storage_options={})
    info = {"model": "m", "top_k": 2, "started_at": "2026-12-01T00:00:00+00:00"}
    (out / "_SUCCESS").write_text(json.dumps(info))
    (out / "mine.txt").write_text("keep")
    (out / "ab").mkdir(exist_ok=True)
    (out / "ab" / "notes.md").write_text("keep")
    (out / ".part-0123456789abcdef01234567.parquet.0123456789abcdef0123456789abcdef.tmp").write_bytes(b"PAR1")
    fs, root = open_fs(str(out))
    check_output(fs, root, str(out))
    begin_output(fs, root, info)
    assert not (out / "_SUCCESS").exists() and committed_parts(fs, root)  # a stale _SUCCESS goes, shards stay
    assert not list(out.glob(".*.tmp"))  # an interrupted run's temporary file is reclaimed
    begin_output(fs, root, info, overwrite=True)
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert left == ["_RUN.json", "ab", "ab/notes.md", "mine.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="is a file; give a folder or prefix"):
        check_output(*open_fs(str(tmp_path / "file")), str(tmp_path / "file"))


@pytest.mark.parametrize("below", ["sub", "sub/deeper"])
def test_an_output_under_a_file_is_refused_in_one_line_before_anything_is_written(tmp_path, below):
    (tmp_path / "afile").write_text("not a folder")
    url = str(tmp_path / "afile" / below)
    fs, root = open_fs(url)
    with pytest.raises(OutputError, match=rf"^--output '{url}' is under '{tmp_path}/afile', which is a file, so no "
                                          r"folder can be made there; choose another --output \(or move that file\)$"):
        check_output(fs, root, url)
    assert (tmp_path / "afile").read_text() == "not a folder"
