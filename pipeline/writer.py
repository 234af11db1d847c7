"""Writing output: each shard's rows committed atomically under a name derived from its content."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
import uuid
from collections import Counter
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.schema import CALLS, DECODE_S, FETCH_S, INFER_S, OUTPUT_SCHEMA, conform
from pipeline.source import is_local, open_fs

LOG = logging.getLogger(__name__)
PART_PREFIX = "part-"
SHARD_META_KEY = b"bulk_classify.shard"
COMMIT_SCHEMA = pa.schema(
    [
        ("shard", pa.string()),
        ("rows", pa.int64()),
        ("ok", pa.int64()),
        ("errors", pa.int64()),
        ("carried", pa.int64()),
        ("error_kinds", pa.string()),  # JSON {kind: count}
        ("fetch_s", pa.float64()),
        ("decode_s", pa.float64()),  # null when the engine cannot separate decoding from inference
        ("infer_s", pa.float64()),
        ("write_s", pa.float64()),
        ("engine_calls", pa.float64()),
    ]
)


def shard_id(uris: list[str]) -> str:
    """Deterministic id of a shard: the same rows give the same name, so a retried write replaces, never adds."""
    h = hashlib.blake2b(digest_size=12)
    for u in sorted(uris):
        h.update(u.encode())
        h.update(b"\0")
    return h.hexdigest()


def part_name(shard: str) -> str:
    return f"{PART_PREFIX}{shard}.parquet"


def commit_table(fs: Any, dest: str, name: str, table: pa.Table, metadata: Mapping[bytes, bytes]) -> None:
    """Write one Parquet file so readers see all of it or none of it.

    Local and POSIX-like file systems: a hidden temporary name, fsync, then rename (atomic in one folder).
    Object stores: one PUT of the whole object, which S3 and its kin make visible atomically.
    """
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    payload = buf.getvalue()
    final = f"{dest.rstrip('/')}/{name}"
    if is_local(fs):
        tmp = f"{dest.rstrip('/')}/.{name}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    else:
        fs.pipe_file(final, payload)


def write_shard(batch: pa.Table, *, output: str, storage_options: Mapping[str, Any]) -> pa.Table:
    """Commit one batch of finished rows as a Parquet shard; return a one-row commit record."""
    start = time.perf_counter()
    fs, dest = open_fs(output, storage_options)
    uris = batch.column("uri").to_pylist()
    shard = shard_id(uris)
    rows = conform(batch, OUTPUT_SCHEMA)
    statuses = rows.column("status").to_pylist()
    kinds = Counter(e.split(":", 1)[0] for e in rows.column("error").to_pylist() if e)
    commit_table(fs, dest, part_name(shard), rows, {SHARD_META_KEY: shard.encode()})
    carried = sum(1 for c in rows.column("carried").to_pylist() if c)

    def total(col: str) -> float:
        return float(sum(v for v in batch.column(col).to_pylist() if v is not None)) if col in batch.column_names else 0.0

    record = {
        "shard": [shard],
        "rows": [rows.num_rows],
        "ok": [statuses.count("ok")],
        "errors": [statuses.count("error")],
        "carried": [carried],
        "error_kinds": [json.dumps(dict(kinds))],
        "fetch_s": [total(FETCH_S)],
        "decode_s": [total(DECODE_S) if _any(batch, DECODE_S) else None],
        "infer_s": [total(INFER_S)],
        "write_s": [time.perf_counter() - start],
        "engine_calls": [total(CALLS)],
    }
    return pa.Table.from_pydict(record, schema=COMMIT_SCHEMA)


def _any(batch: pa.Table, col: str) -> bool:
    return col in batch.column_names and batch.column(col).null_count < batch.num_rows


def committed_parts(fs: Any, dest: str) -> list[str]:
    """Paths of committed shards in DEST (temporary and bookkeeping files start with '.' or '_')."""
    if not fs.exists(dest):
        return []
    return sorted(p for p in fs.ls(dest, detail=False) if p.rsplit("/", 1)[-1].startswith(PART_PREFIX)
                  and p.endswith(".parquet"))


def read_columns(fs: Any, paths: list[str], columns: list[str]) -> pa.Table:
    """Read a few columns of committed shards (the resume set, the previous run's identities)."""
    if not paths:
        return pa.table({c: pa.array([], OUTPUT_SCHEMA.field(c).type) for c in columns})
    import pyarrow.dataset as ds

    dataset = ds.dataset(paths, filesystem=fs, format="parquet", schema=OUTPUT_SCHEMA)
    return dataset.to_table(columns=columns)


def write_json(fs: Any, dest: str, name: str, payload: Mapping[str, Any]) -> None:
    data = json.dumps(payload, indent=2, sort_keys=True, default=str).encode()
    path = f"{dest.rstrip('/')}/{name}"
    if is_local(fs):
        tmp = f"{dest.rstrip('/')}/.{name}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)


def read_json(fs: Any, dest: str, name: str) -> dict[str, Any] | None:
    path = f"{dest.rstrip('/')}/{name}"
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:
        LOG.warning("%s is not JSON; ignored", path)
        return None


def open_dest(output: str, storage_options: Mapping[str, Any]):
    return open_fs(output, storage_options)
