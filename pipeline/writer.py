"""Writing output and reading it back: each shard's rows committed atomically under a name derived from its content,
with its record in the footer; and the readers of those shards, footers and records (``committed_parts``,
``read_record``, ``read_shard``, ``iter_records``, ``read_columns``) and of the JSON bookkeeping files."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import os
import re
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.schema import (
    BOOKKEEPING, CALLS, DECODE_S, ENGINE_EVENTS, FETCH_S, GROUP_CHARS, INFER_S, LEASE, OUTPUT_SCHEMA, PART_PREFIX,
    PART_SUFFIX, RECORD_KEY, SHARD_META_KEY, conform,
)
from pipeline.keys import identity_hashes, uri_hashes
from pipeline.source import is_local, open_fs
from pipeline.stats import ShardStats

LOG = logging.getLogger(__name__)
GROUP_RE = re.compile(rf"^[0-9a-f]{{{GROUP_CHARS}}}$")
SHARD_ID_BYTES = 12
# Temporary names this tool writes before a rename: "." + the final name + "." + 32 hex digits + ".tmp".
TEMP_RE = re.compile(r"^\.(?:{}|{})\.[0-9a-f]{{32}}\.tmp$".format(
    re.escape(PART_PREFIX) + f"[0-9a-f]{{{2 * SHARD_ID_BYTES}}}" + re.escape(PART_SUFFIX),
    "|".join(re.escape(name) for name in (*BOOKKEEPING, LEASE))))
RECORD_VERSION = 2  # 2: the hash arrays are in row order (1: sorted), so a carry task can reuse them per row
FOOTER_READERS = 16  # concurrent footer reads on object stores


def shard_id(uris: list[str]) -> str:
    """Deterministic id of a shard: the same rows give the same name, so a retried write replaces, never adds."""
    h = hashlib.blake2b(digest_size=SHARD_ID_BYTES)
    for u in sorted(uris):
        h.update(u.encode())
        h.update(b"\0")
    return h.hexdigest()


def part_name(shard: str) -> str:
    """Path of a shard relative to DEST: ``<group>/part-<shard>.parquet``."""
    return f"{shard[:GROUP_CHARS]}/{PART_PREFIX}{shard}{PART_SUFFIX}"


@dataclass
class ShardRecord:
    """A committed shard's record, read from its Parquet footer: counts and the hashes resume and carry-over need."""

    rows: int
    ok: int
    errors: int
    carried: int
    model: str | None
    top_k: int | None
    uri_hashes: np.ndarray  # int64 uri_hash of every row
    identities: np.ndarray  # int64 identity_hash of the ok rows (the ones a later run may carry)
    row_order: bool = True  # the arrays follow the shard's rows (ok rows only for identities); False: sorted

    def to_json(self) -> bytes:
        return json.dumps({
            "version": RECORD_VERSION if self.row_order else 1, "rows": self.rows, "ok": self.ok, "errors": self.errors,
            "carried": self.carried, "model": self.model, "top_k": self.top_k,
            "uri_hashes": base64.b64encode(self.uri_hashes.astype("<i8").tobytes()).decode(),
            "identities": base64.b64encode(self.identities.astype("<i8").tobytes()).decode(),
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "ShardRecord":
        d = json.loads(data)
        arrays = {k: np.frombuffer(base64.b64decode(d[k]), dtype="<i8").astype(np.int64) for k in
                  ("uri_hashes", "identities")}
        return cls(rows=d["rows"], ok=d["ok"], errors=d["errors"], carried=d["carried"], model=d["model"],
                   top_k=d["top_k"], row_order=d.get("version", 1) >= 2, **arrays)

    @classmethod
    def of_rows(cls, rows: pa.Table, *, uri_keys: np.ndarray | None = None,
                identities: np.ndarray | None = None) -> "ShardRecord":
        """The record of output rows (also how a shard written before records existed is read).

        ``uri_keys`` (every row) and ``identities`` (the ok rows), in row order, when the caller has them already:
        carried rows come with their previous shard's hashes, so they are not hashed again.
        """
        status = rows.column("status")
        ok_mask = pc.fill_null(pc.equal(status, "ok"), False)
        ok_rows = rows.filter(ok_mask)
        lengths = pc.unique(pc.list_value_length(ok_rows.column("class_ids"))).to_pylist() if ok_rows.num_rows else []
        models = pc.unique(rows.column("model")).to_pylist() if "model" in rows.column_names else []
        carried = rows.column("carried") if "carried" in rows.column_names else pa.array([], pa.bool_())
        return cls(
            rows=rows.num_rows,
            ok=ok_rows.num_rows,
            errors=rows.num_rows - ok_rows.num_rows,
            carried=int(pc.sum(pc.fill_null(carried, False)).as_py() or 0),
            model=models[0] if len(models) == 1 else None,
            top_k=lengths[0] if len(lengths) == 1 else None,
            uri_hashes=uri_keys if uri_keys is not None else uri_hashes(rows.column("uri").to_pylist()),
            identities=identities if identities is not None else row_identities(ok_rows),
        )


def row_identities(rows: pa.Table) -> np.ndarray:
    """``identity_hash`` of output or listing rows (uri, etag, size_bytes, mtime)."""
    mtimes = pc.cast(rows.column("mtime"), pa.int64()).to_pylist()
    return identity_hashes(rows.column("uri").to_pylist(), rows.column("etag").to_pylist(),
                           rows.column("size_bytes").to_pylist(), mtimes)


def commit_table(fs: Any, dest: str, name: str, table: pa.Table, metadata: Mapping[bytes, bytes]) -> None:
    """Write one Parquet file so readers see all of it or none of it (``name`` may hold one folder level).

    Local and POSIX-like file systems: a hidden temporary name, fsync, then rename (atomic in one folder).
    Object stores: one PUT of the whole object, which S3 and its kin make visible atomically.
    """
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    payload = buf.getvalue()
    final = f"{dest.rstrip('/')}/{name}"
    if is_local(fs):
        folder, base = final.rsplit("/", 1)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{folder}/.{base}.{uuid.uuid4().hex}.tmp"
        _write_then_rename(tmp, final, payload, sync=True)
    else:
        fs.pipe_file(final, payload)


def _write_then_rename(tmp: str, final: str, payload: bytes, *, sync: bool) -> None:
    """Write ``tmp`` and rename it to ``final``; a failed write (a full disk) removes ``tmp`` again."""
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # the next run reclaims it (pipeline.job.output.reclaim_temporary)
        raise


def write_shard(batch: pa.Table, *, output: str, storage_options: Mapping[str, Any],
                footer: Callable[[pa.Table], Mapping[bytes, bytes]] | None = None,
                record: ShardRecord | None = None) -> pa.Table:
    """Commit one batch of finished rows as a Parquet shard with its record; return its ``ShardStats`` row.

    ``footer(rows)`` may add more key-value metadata to the shard's footer (the job adds quality counters).
    ``record`` is the rows' record when the caller built it already (``ShardRecord.of_rows`` with known hashes).
    """
    start = time.perf_counter()
    fs, dest = open_fs(output, storage_options)
    shard = shard_id(batch.column("uri").to_pylist())
    rows = conform(batch, OUTPUT_SCHEMA)
    record = record if record is not None else ShardRecord.of_rows(rows)
    kinds = Counter(e.split(":", 1)[0] for e in pc.drop_null(rows.column("error")).to_pylist() if e)
    extra = dict(footer(rows)) if footer is not None else {}
    commit_table(fs, dest, part_name(shard), rows, {**extra, SHARD_META_KEY: shard.encode(),
                                                    RECORD_KEY: record.to_json()})

    def total(col: str) -> float:
        return float(pc.sum(batch.column(col)).as_py() or 0.0) if col in batch.column_names else 0.0

    stats = ShardStats(
        rows=record.rows, ok=record.ok, errors=record.errors, carried=record.carried, error_kinds=dict(kinds),
        fetch_s=total(FETCH_S), decode_s=total(DECODE_S) if _any(batch, DECODE_S) else None, infer_s=total(INFER_S),
        write_s=time.perf_counter() - start, engine_calls=total(CALLS), engine_events=_events(batch),
    )
    return stats.to_table()


class ShardWriter:
    """Callable class for the job's write stage: a long-lived process commits shard after shard (``write_shard``).

    As tasks, each shard started a Ray worker of its own once backpressure kept the fetch task holding its worker:
    19 workers in a 20,000-image run, each importing Ray Data and pyarrow (about 2 CPU-s) to write for 0.1 s.
    """

    def __init__(self, *, output: str, storage_options: Mapping[str, Any],
                 footer: Callable[[pa.Table], Mapping[bytes, bytes]] | None = None):
        self.output, self.storage_options, self.footer = output, dict(storage_options), footer

    def __call__(self, batch: pa.Table) -> pa.Table:
        return write_shard(batch, output=self.output, storage_options=self.storage_options, footer=self.footer)


def _events(batch: pa.Table) -> dict[str, int]:
    """The sum of the rows' engine counters (``ENGINE_EVENTS``)."""
    out: dict[str, int] = {}
    if ENGINE_EVENTS in batch.column_names:
        for text in pc.drop_null(batch.column(ENGINE_EVENTS)).to_pylist():
            for event, n in json.loads(text).items():
                out[event] = out.get(event, 0) + int(n)
    return out


def _any(batch: pa.Table, col: str) -> bool:
    return col in batch.column_names and batch.column(col).null_count < batch.num_rows


def committed_parts(fs: Any, dest: str) -> list[str]:
    """Paths of committed shards in DEST and its group folders (older flat outputs hold them in DEST itself).

    Temporary and bookkeeping files start with '.' or '_' and are never listed.
    """
    if not fs.exists(dest):
        return []
    parts, groups = [], []
    for info in fs.ls(dest, detail=True):
        base = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if info.get("type") == "directory" and GROUP_RE.match(base):
            groups.append(info["name"])
        elif _is_part(base):
            parts.append(info["name"])
    for group in groups:
        parts.extend(p for p in fs.ls(group, detail=False) if _is_part(p.rsplit("/", 1)[-1]))
    return sorted(parts)


def _is_part(base: str) -> bool:
    return base.startswith(PART_PREFIX) and base.endswith(PART_SUFFIX)


def is_committed_shard(fs: Any, path: str) -> bool:
    """Whether ``path`` is a shard this tool committed: a Parquet file whose footer holds our commit record and our
    shard id, the one its name carries."""
    base = path.rsplit("/", 1)[-1]
    if not _is_part(base):
        return False
    try:
        footer = read_footer(fs, path)
    except Exception:  # noqa: BLE001 - not Parquet, or unreadable: not ours to delete
        return False
    shard = footer.get(SHARD_META_KEY, b"").decode(errors="replace")
    return RECORD_KEY in footer and base == f"{PART_PREFIX}{shard}{PART_SUFFIX}"


def read_footer(fs: Any, path: str) -> dict[bytes, bytes]:
    """The key-value metadata of a shard's Parquet footer (one ranged read on object stores)."""
    if is_local(fs):
        meta = pq.read_metadata(path)
    else:
        with fs.open(path, "rb", block_size=1 << 17) as f:
            meta = pq.ParquetFile(f).metadata
    return meta.metadata or {}


def read_record(fs: Any, path: str, footer: Mapping[bytes, bytes] | None = None) -> ShardRecord:
    """A shard's record from its footer (``footer``, when read already); a shard without one (an older output) is
    read and hashed instead."""
    raw = (footer if footer is not None else read_footer(fs, path)).get(RECORD_KEY)
    if raw is not None:
        return ShardRecord.from_json(raw)
    columns = ["uri", "status", "class_ids", "model", "carried", "etag", "size_bytes", "mtime"]
    return ShardRecord.of_rows(read_columns(fs, [path], columns))


def read_shard(fs: Any, path: str) -> tuple[pa.Table, ShardRecord | None]:
    """A committed shard's rows (``OUTPUT_SCHEMA``) and its record, from one open of the file (None: no record)."""
    if is_local(fs):
        pf = pq.ParquetFile(path)
        raw = (pf.metadata.metadata or {}).get(RECORD_KEY)
        table = pf.read()
    else:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            raw = (pf.metadata.metadata or {}).get(RECORD_KEY)
            table = pf.read()
    return conform(table.replace_schema_metadata(None), OUTPUT_SCHEMA), (
        ShardRecord.from_json(raw) if raw is not None else None)


def iter_records(fs: Any, paths: list[str]) -> Iterator[tuple[str, ShardRecord]]:
    """Records of many shards, read concurrently on object stores, in order, a bounded window at a time."""
    for path, footer in iter_footers(fs, paths):
        yield path, read_record(fs, path, footer)


def iter_footers(fs: Any, paths: list[str]) -> Iterator[tuple[str, dict[bytes, bytes]]]:
    """Footer metadata of many shards, read concurrently on object stores, in order, a bounded window at a time."""
    if is_local(fs):
        for path in paths:
            yield path, read_footer(fs, path)
        return
    with ThreadPoolExecutor(FOOTER_READERS) as pool:
        for i in range(0, len(paths), FOOTER_READERS * 4):
            window = paths[i:i + FOOTER_READERS * 4]
            yield from zip(window, pool.map(lambda p: read_footer(fs, p), window))


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
        _write_then_rename(f"{dest.rstrip('/')}/.{name}.{uuid.uuid4().hex}.tmp", path, data, sync=False)
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
