"""Fetching bytes: concurrent reads with bounded retries; a permanent failure becomes that object's error row."""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from pipeline.errors import ConfigError, ImageError
from pipeline.io.keys import uri_path
from pipeline.schema import DATA, ERROR, FETCH_S, SIZE_BYTES, STATUS, STATUS_ERROR, URI
from pipeline.storage import manifest_form, open_fs

LOG = logging.getLogger(__name__)
BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 8.0
_FS_CACHE: dict[Any, Any] = {}
_POOLS: dict[int, ThreadPoolExecutor] = {}


def classify_failure(err: BaseException) -> str | None:
    """Error kind of a permanent failure, or None when the error is transient and worth retrying."""
    if isinstance(err, FileNotFoundError):
        return "not_found"
    if isinstance(err, PermissionError):
        return "permission_denied"
    if isinstance(err, (IsADirectoryError, NotADirectoryError)):
        return "not_found"
    return None


def _read_local(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_with_retries(fs: Any, path: str, retries: int, sleep=time.sleep) -> bytes:
    """Read one object; transient errors (timeouts, 5xx, resets, refused connections) are retried with backoff."""
    # A local file is read directly: fsspec's LocalFileOpener costs more CPU than reading a typical image.
    read = _read_local if isinstance(fs, LocalFileSystem) else fs.cat_file
    attempt = 0
    while True:
        try:
            return read(path)
        except Exception as err:  # noqa: BLE001 - sorted into permanent and transient below
            kind = classify_failure(err)
            if kind is not None:
                raise ImageError(kind, _short(err)) from None
            if attempt >= retries:
                raise ImageError("fetch_error", f"gave up after {retries + 1} attempts: {_short(err)}") from None
            delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt) * (0.5 + random.random() / 2)
            LOG.warning("transient error reading %r (attempt %d): %s; retrying in %.1fs", path, attempt + 1,
                        _short(err), delay)
            sleep(delay)
            attempt += 1
            if attempt in (2, 4):  # a long outage may have broken the client's connection pool
                fs.invalidate_cache()


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text[:300]


def _pool(threads: int) -> ThreadPoolExecutor:
    """The fetch threads of this worker process, kept between batches (starting threads per batch showed up in
    py-spy of the fetch tasks)."""
    threads = max(1, threads)
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fetch")
    return _POOLS[threads]


def _filesystem(url: str, storage_options: Mapping[str, Any]):
    key = (url, tuple(sorted((k, repr(v)) for k, v in storage_options.items())))
    if key not in _FS_CACHE:
        _FS_CACHE[key] = open_fs(url, storage_options)[0]
    return _FS_CACHE[key]


def fetch_batch(
    batch: pa.Table,
    *,
    source: str | None,
    storage_options: Mapping[str, Any],
    threads: int,
    max_bytes: int,
    retries: int,
) -> pa.Table:
    """Add the encoded bytes of every row that needs classifying; failures fill ``status``/``error``.

    ``source`` None: the URIs are any store's (``scheme://…``), as a manifest's are.
    """
    # A manifest names objects on any store: each row is read through its own scheme's file system.
    fs_of = (lambda uri: _filesystem(uri.partition("://")[0] + "://", storage_options)) \
        if source is None or manifest_form(source) \
        else (lambda uri, fs=_filesystem(source, storage_options): fs)
    uris = batch.column(URI).to_pylist()
    sizes = batch.column(SIZE_BYTES).to_pylist()
    status = batch.column(STATUS).to_pylist()
    error = batch.column(ERROR).to_pylist()
    data: list[bytes | None] = [None] * len(uris)

    def one(i: int) -> None:
        if status[i] is not None:  # an error row from the listing
            return
        if sizes[i] is not None and sizes[i] > max_bytes:
            status[i], error[i] = STATUS_ERROR, f"too_large: {sizes[i]} bytes > max_bytes={max_bytes}; raise --max-bytes"
            return
        try:
            fs = fs_of(uris[i])
            data[i] = read_with_retries(fs, fs._strip_protocol(uri_path(uris[i])), retries)
        except ImageError as err:
            status[i], error[i] = STATUS_ERROR, str(err)
        except ConfigError as err:  # a scheme this worker has no file system for (the driver checked its own)
            status[i], error[i] = STATUS_ERROR, str(ImageError("fetch_error", f"{err} on this worker"))

    start = time.perf_counter()
    list(_pool(threads).map(one, range(len(uris))))
    per_row = (time.perf_counter() - start) / max(1, len(uris))
    out = batch
    for name, values, typ in (
        (STATUS, status, pa.string()),
        (ERROR, error, pa.string()),
        (DATA, data, pa.binary()),
        (FETCH_S, [per_row] * len(uris), pa.float64()),
    ):
        out = out.set_column(out.schema.get_field_index(name), name, pa.array(values, typ))
    return out
