"""Listing the source: recursive, extension-filtered, streamed per sub-prefix as a Ray Data datasource."""

from __future__ import annotations

import hashlib
import logging
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator, Mapping

import fsspec
import numpy as np
import pyarrow as pa
from ray.data import Datasource

from pipeline.errors import ConfigError, SourceError

LOG = logging.getLogger(__name__)
BLOCK_ROWS = 1000  # rows per listing block: small enough that classification starts early
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
LISTING_SCHEMA = pa.schema(
    [
        ("uri", pa.string()),
        ("size_bytes", pa.int64()),
        ("etag", pa.string()),
        ("mtime", pa.timestamp("us", tz="UTC")),
        ("carried", pa.bool_()),
    ]
)


def open_fs(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a folder or fsspec URL to (filesystem, path); an unknown scheme fails with the package to install."""
    try:
        return fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as err:
        raise ConfigError(f"cannot open {url!r}: {err}; install the fsspec package for that scheme") from None
    except ValueError as err:
        if "Protocol not known" in str(err):
            scheme = url.split("://", 1)[0]
            raise ConfigError(f"cannot open {url!r}: unknown scheme {scheme!r}; use a folder, file:// or s3://, "
                              "or install the fsspec package for that scheme") from None
        raise ConfigError(f"cannot open {url!r}: {err}; check the URL and --storage-option values") from None
    except TypeError as err:
        raise ConfigError(f"bad --storage-option for {url!r}: {err}") from None


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def storage_failure(url: str, err: BaseException) -> str:
    """One line for a storage error that stops a run before it starts, with the usual fixes."""
    text = f"{type(err).__name__}: {err}".strip().replace("\n", " ")
    hint = "check the URL, credentials (AWS_* environment or --storage-option) and AWS_ENDPOINT_URL"
    if isinstance(err, PermissionError):
        hint = "check the credentials and the bucket policy (AWS_* environment or --storage-option)"
    return f"cannot read {url!r}: {text[:300]}; {hint}"


def check_source(fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
    """Fail before any work when the source is missing, not a folder, or the storage can't be reached."""
    try:
        exists = fs.exists(root)
        kind = fs.info(root).get("type") if exists else None
    except Exception as err:  # noqa: BLE001 - any storage failure here is the user's to fix
        raise SourceError(storage_failure(url, err)) from None
    if not exists:
        raise SourceError(f"source {url!r} does not exist; check the path or bucket prefix")
    if kind != "directory":
        raise SourceError(f"source {url!r} is a {kind}, not a folder or prefix; give the folder that holds the images")


def uri_hash(uri: str) -> int:
    """A stable signed 64-bit key of a URI, for compact membership sets across processes."""
    return int.from_bytes(hashlib.blake2b(uri.encode(), digest_size=8).digest(), "little", signed=True)


def identity_hash(uri: str, etag: str | None, size: int | None, mtime_us: int | None) -> int:
    """Key of an object's version: the ETag when the storage has one, else size and mtime (in microseconds)."""
    if etag:
        key = f"{uri}\0e\0{etag}\0{size}"
    else:
        key = f"{uri}\0m\0{size}\0{mtime_us}"
    return uri_hash(key)


def mtime_us(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return (value - _EPOCH) // timedelta(microseconds=1)
    if isinstance(value, (int, float)):
        return int(float(value) * 1_000_000)
    try:
        return mtime_us(datetime.fromisoformat(str(value)))
    except ValueError:
        return None


def entry_row(fs: fsspec.AbstractFileSystem, info: Mapping[str, Any]) -> dict[str, Any]:
    etag = info.get("ETag") or info.get("etag")
    stamp = mtime_us(info.get("LastModified") or info.get("mtime") or info.get("last_modified"))
    return {
        "uri": fs.unstrip_protocol(info["name"]),
        "size_bytes": int(info.get("size") or 0),
        "etag": str(etag).strip('"') if etag else None,
        "mtime": stamp,
        "carried": False,
    }


def matches(name: str, extensions: tuple[str, ...]) -> bool:
    base = name.rsplit("/", 1)[-1]
    if base.startswith("."):
        return False
    _, dot, ext = base.rpartition(".")
    return bool(dot) and ext.lower() in extensions


def walk_files(fs: fsspec.AbstractFileSystem, root: str, extensions: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """Yield listing rows under ``root`` in a stable order, one directory at a time."""
    for _dirpath, _dirs, files in fs.walk(root, detail=True):
        for name in sorted(files):
            info = files[name]
            if info.get("type", "file") == "file" and matches(info["name"], extensions):
                yield entry_row(fs, info)


def partitions(fs: fsspec.AbstractFileSystem, root: str, extensions: tuple[str, ...], parallelism: int) -> list[list]:
    """Split the listing into up to ``parallelism`` groups of top-level entries, so sub-prefixes list in parallel."""
    entries = sorted(fs.ls(root, detail=True), key=lambda e: e["name"])
    files = [e for e in entries if e.get("type") == "file" and matches(e["name"], extensions)]
    dirs = [e["name"] for e in entries if e.get("type") == "directory" and e["name"].rstrip("/") != root.rstrip("/")]
    groups: list[list] = [[] for _ in range(max(1, min(parallelism, len(dirs) + (1 if files else 0))))]
    for i, d in enumerate(dirs):
        groups[i % len(groups)].append(("dir", d))
    if files:
        groups[-1].append(("files", files))
    return groups


def _rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=LISTING_SCHEMA)


def sorted_keys(values) -> np.ndarray:
    return np.unique(np.asarray(list(values), dtype=np.int64))


def contains(keys: np.ndarray, value: int) -> bool:
    if keys.size == 0:
        return False
    i = np.searchsorted(keys, value)
    return bool(i < keys.size and keys[i] == value)


class ListingDatasource(Datasource):
    """Ray Data datasource over a recursive listing: one read task per group of sub-prefixes.

    Rows already committed in DEST (``skip_keys``: uri hashes) are dropped; rows whose version matches a
    row of the previous run (``previous``: a Ray object holding that table with an ``_identity`` column)
    come out complete with that row and ``carried=True``, so nothing downstream touches their bytes.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any],
        extensions: tuple[str, ...],
        *,
        skip_keys: np.ndarray,
        previous: Any = None,
        counter: Any = None,
    ):
        self.url = url
        self.storage_options = dict(storage_options)
        self.extensions = extensions
        self.skip_keys = skip_keys
        self.previous = previous
        self.counter = counter

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_name(self) -> str:
        return "Listing"

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None):
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        fs, root = open_fs(self.url, self.storage_options)
        groups = partitions(fs, root, self.extensions, max(1, parallelism))
        tasks = []
        for group in groups:
            meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
            tasks.append(ReadTask(lambda g=group: self._read(g), meta))
        return tasks

    def _read(self, group: list) -> Iterator[pa.Table]:
        from pipeline.schema import WORK_SCHEMA, conform

        fs, _root = open_fs(self.url, self.storage_options)
        previous = _resolve_previous(self.previous)
        prev_keys = previous.column("_identity").to_numpy() if previous is not None else np.empty(0, np.int64)
        fresh: list[dict[str, Any]] = []
        carried_idx: list[int] = []
        skipped = 0

        clock = [time.perf_counter()]  # listing time excludes the waits while downstream consumes a block

        def flush() -> Iterator[pa.Table]:
            nonlocal fresh, carried_idx, skipped
            parts = []
            if fresh:
                parts.append(conform(_rows_to_table(fresh), WORK_SCHEMA))
            if carried_idx:
                rows = previous.take(pa.array(carried_idx, pa.int64())).drop_columns(["_identity"])
                rows = rows.set_column(rows.schema.get_field_index("carried"), "carried",
                                       pa.array([True] * rows.num_rows))
                parts.append(conform(rows, WORK_SCHEMA))
            if self.counter is not None:
                self.counter.add.remote(len(fresh) + len(carried_idx), skipped, time.perf_counter() - clock[0])
            fresh, carried_idx, skipped = [], [], 0
            if parts:
                yield pa.concat_tables(parts)
            clock[0] = time.perf_counter()

        for kind, item in group:
            rows = walk_files(fs, item, self.extensions) if kind == "dir" else (entry_row(fs, e) for e in item)
            for row in rows:
                if contains(self.skip_keys, uri_hash(row["uri"])):
                    skipped += 1
                    continue
                if prev_keys.size:
                    key = identity_hash(row["uri"], row["etag"], row["size_bytes"], row["mtime"])
                    i = np.searchsorted(prev_keys, key)
                    if i < prev_keys.size and prev_keys[i] == key:
                        carried_idx.append(int(i))
                        continue
                fresh.append(row)
                if len(fresh) + len(carried_idx) >= BLOCK_ROWS:
                    yield from flush()
        yield from flush()


_PREVIOUS_CACHE: dict[Any, pa.Table] = {}


def _resolve_previous(ref: Any) -> pa.Table | None:
    if ref is None:
        return None
    if isinstance(ref, pa.Table):
        return ref
    key = ref.hex() if hasattr(ref, "hex") else id(ref)
    if key not in _PREVIOUS_CACHE:
        import ray

        _PREVIOUS_CACHE.clear()
        _PREVIOUS_CACHE[key] = ray.get(ref)
    return _PREVIOUS_CACHE[key]
