"""pipeline/io/fetch.py: retries of transient storage errors, permanent errors as rows, the byte cap.

The storage is fsspec's in-memory file system with failures injected per path; the S3 outage itself is covered
end to end against moto's server in tests/integration/test_faults.py.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from pipeline.io import fetch
from pipeline.errors import ImageError
from pipeline.schema import DATA, FETCH_S, WORK_SCHEMA


class FlakyMemory(MemoryFileSystem):
    """In-memory files; ``failures[path]`` exceptions are raised, one per read, before the read succeeds."""

    def __init__(self, failures=None, **kw):
        super().__init__(**kw)
        self.failures = {k: list(v) for k, v in (failures or {}).items()}
        self.reads: list[str] = []
        self.invalidations = 0

    def cat_file(self, path, start=None, end=None, **kw):
        self.reads.append(path)
        pending = self.failures.get(path)
        if pending:
            raise pending.pop(0)
        return super().cat_file(path, start, end, **kw)

    def invalidate_cache(self, path=None):
        self.invalidations += 1


@pytest.fixture
def fs():
    memory = FlakyMemory(skip_instance_cache=True)
    memory.store.clear()
    memory.pipe("/bucket/a.jpg", b"a-bytes")
    return memory


def test_transient_errors_are_retried_with_growing_bounded_backoff(fs):
    fs.failures["/bucket/a.jpg"] = [ConnectionError("reset"), TimeoutError("slow"), OSError("503")]
    sleeps: list[float] = []
    assert fetch.read_with_retries(fs, "/bucket/a.jpg", retries=5, sleep=sleeps.append) == b"a-bytes"
    assert len(fs.reads) == 4 and len(sleeps) == 3
    for attempt, delay in enumerate(sleeps):  # full backoff halved at most by jitter
        full = min(fetch.BACKOFF_MAX_S, fetch.BACKOFF_BASE_S * 2**attempt)
        assert full / 2 <= delay <= full
    assert fs.invalidations == 1  # after the second failed attempt: a long outage may have broken the pool


def test_giving_up_is_a_fetch_error_row_that_says_how_often(fs):
    fs.failures["/bucket/a.jpg"] = [ConnectionError("connection refused")] * 10
    with pytest.raises(ImageError, match=r"fetch_error: gave up after 3 attempts: ConnectionError: connection "
                                         r"refused") as err:
        fetch.read_with_retries(fs, "/bucket/a.jpg", retries=2, sleep=lambda s: None)
    assert err.value.kind == "fetch_error" and len(fs.reads) == 3


@pytest.mark.parametrize("exc, kind", [
    (FileNotFoundError("gone"), "not_found"),
    (PermissionError("denied"), "permission_denied"),
    (IsADirectoryError("dir"), "not_found"),
])
def test_permanent_errors_are_not_retried(fs, exc, kind):
    fs.failures["/bucket/a.jpg"] = [exc]
    with pytest.raises(ImageError) as err:
        fetch.read_with_retries(fs, "/bucket/a.jpg", retries=5, sleep=lambda s: pytest.fail("no retry"))
    assert err.value.kind == kind and len(fs.reads) == 1


def _batch(rows: list[dict]) -> pa.Table:
    columns = {f.name: [r.get(f.name) for r in rows] for f in WORK_SCHEMA}
    columns["carried"] = [bool(r.get("carried")) for r in rows]
    return pa.table(columns, schema=WORK_SCHEMA)


def test_fetch_batch_fills_bytes_and_error_rows(fs, monkeypatch):
    fs.pipe("/bucket/big.jpg", b"x" * 100)
    fs.failures["/bucket/flaky.jpg"] = [ConnectionError("reset")]
    fs.pipe("/bucket/flaky.jpg", b"flaky-bytes")
    monkeypatch.setattr(fetch, "_filesystem", lambda url, options: fs)
    monkeypatch.setattr(fetch, "BACKOFF_BASE_S", 0.0)
    batch = _batch([
        {"uri": "memory:///bucket/a.jpg", "size_bytes": 7},
        {"uri": "memory:///bucket/missing.jpg", "size_bytes": 1},
        {"uri": "memory:///bucket/big.jpg", "size_bytes": 100},
        {"uri": "memory:///bucket/flaky.jpg", "size_bytes": 11},
        {"uri": "memory:///bucket/old.jpg", "size_bytes": 5, "carried": True, "status": "ok"},
    ])
    out = fetch.fetch_batch(batch, source="memory:///bucket", storage_options={}, threads=4, max_bytes=50, retries=2)
    assert out.schema == WORK_SCHEMA and out.num_rows == 5
    assert out.column(DATA).to_pylist() == [b"a-bytes", None, None, b"flaky-bytes", None]
    assert out.column("status").to_pylist() == [None, "error", "error", None, "ok"]
    errors = out.column("error").to_pylist()
    assert errors[1].startswith("not_found: FileNotFoundError")
    assert errors[2] == "too_large: 100 bytes > max_bytes=50; raise --max-bytes"
    assert "/bucket/old.jpg" not in fs.reads and "/bucket/big.jpg" not in fs.reads  # neither is read at all
    assert all(s >= 0 for s in out.column(FETCH_S).to_pylist())


def test_a_uri_whose_scheme_this_worker_cannot_open_is_a_fetch_error_row():
    # The driver refuses a list naming a scheme it cannot open; a worker without the driver's package gets rows.
    batch = _batch([{"uri": "nosuchfs://bucket/a.jpg", "size_bytes": 7}])
    out = fetch.fetch_batch(batch, source="uris+/lists/today.txt", storage_options={}, threads=1, max_bytes=50,
                            retries=0)
    assert out.column("status").to_pylist() == ["error"]
    assert out.column("error").to_pylist() == [
        "fetch_error: cannot open 'nosuchfs://': unknown scheme 'nosuchfs'; use a folder, file:// or s3://, or "
        "install the fsspec package for that scheme on this worker"]
