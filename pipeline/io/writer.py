"""Writing output: each shard's rows committed atomically under a name derived from its content, with its record in
the footer, and the JSON bookkeeping files; ``pipeline.io.reader`` reads them back."""

from __future__ import annotations

import base64
import hashlib
import functools
import io
import json
import os
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.columns import conform, output_schema_like
from pipeline.io.keys import identity_hashes, uri_hashes
from pipeline.io.stats import ShardStats
from pipeline.schema import (
    BOOKKEEPING, CALLS, DECODE_S, ENGINE_EVENTS, FETCH_S, GROUP_CHARS, INFER_S, LEASE, PART_PREFIX, PART_SUFFIX,
    RECORD_KEY, SHARD_META_KEY, STATUS_OK,
)
from pipeline.storage import is_local, open_fs

SHARD_ID_BYTES = 12
# Temporary names this tool writes before a rename: "." + the final name + "." + 32 hex digits + ".tmp".
TEMP_RE = re.compile(r"^\.(?:{}|{})\.[0-9a-f]{{32}}\.tmp$".format(
    re.escape(PART_PREFIX) + f"[0-9a-f]{{{2 * SHARD_ID_BYTES}}}" + re.escape(PART_SUFFIX),
    "|".join(re.escape(name) for name in (*BOOKKEEPING, LEASE))))
RECORD_VERSION = 2  # 2: the hash arrays are in row order (1: sorted), so a carry task can reuse them per row


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
    model_digest: str | None = None  # of every row's model; None: several, or written before digests were recorded

    def to_json(self) -> bytes:
        return json.dumps({
            "version": RECORD_VERSION if self.row_order else 1, "rows": self.rows, "ok": self.ok, "errors": self.errors,
            "carried": self.carried, "model": self.model, "model_digest": self.model_digest, "top_k": self.top_k,
            "uri_hashes": base64.b64encode(self.uri_hashes.astype("<i8").tobytes()).decode(),
            "identities": base64.b64encode(self.identities.astype("<i8").tobytes()).decode(),
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "ShardRecord":
        d = json.loads(data)
        arrays = {k: np.frombuffer(base64.b64decode(d[k]), dtype="<i8").astype(np.int64) for k in
                  ("uri_hashes", "identities")}
        return cls(rows=d["rows"], ok=d["ok"], errors=d["errors"], carried=d["carried"], model=d["model"],
                   top_k=d["top_k"], row_order=d.get("version", 1) >= 2, model_digest=d.get("model_digest"),
                   **arrays)

    @classmethod
    def of_rows(cls, rows: pa.Table, *, uri_keys: np.ndarray | None = None,
                identities: np.ndarray | None = None) -> "ShardRecord":
        """The record of output rows (also how a shard written before records existed is read).

        ``uri_keys`` (every row) and ``identities`` (the ok rows), in row order, when the caller has them already:
        carried rows come with their previous shard's hashes, so they are not hashed again.
        """
        status = rows.column("status")
        ok_mask = pc.fill_null(pc.equal(status, STATUS_OK), False)
        ok_rows = rows.filter(ok_mask)
        lengths = _top_k_lengths(ok_rows) if ok_rows.num_rows else []
        models = pc.unique(rows.column("model")).to_pylist() if "model" in rows.column_names else []
        digests = pc.unique(rows.column("model_digest")).to_pylist() if "model_digest" in rows.column_names else []
        carried = rows.column("carried") if "carried" in rows.column_names else pa.array([], pa.bool_())
        return cls(
            rows=rows.num_rows,
            ok=ok_rows.num_rows,
            errors=rows.num_rows - ok_rows.num_rows,
            carried=int(pc.sum(pc.fill_null(carried, False)).as_py() or 0),
            model=models[0] if len(models) == 1 else None,
            model_digest=digests[0] if len(digests) == 1 else None,
            top_k=lengths[0] if len(lengths) == 1 else None,
            uri_hashes=uri_keys if uri_keys is not None else uri_hashes(rows.column("uri").to_pylist()),
            identities=identities if identities is not None else row_identities(ok_rows),
        )


def _top_k_lengths(ok_rows: pa.Table) -> list[int]:
    """The distinct lengths of the ok rows' top-k: one model's ``class_ids``; of a model set, each row's longest (each
    model caps the run's top-k at its own classes, so the longest is the run's)."""
    if "class_ids" in ok_rows.column_names:
        return pc.unique(pc.list_value_length(ok_rows.column("class_ids"))).to_pylist()
    models = [c for f, c in zip(ok_rows.schema, ok_rows.columns)
              if pa.types.is_struct(f.type) and f.type.get_field_index("class_ids") >= 0]
    if not models:
        return []
    longest = [pc.fill_null(pc.list_value_length(pc.struct_field(c, "class_ids")), 0) for c in models]
    return pc.unique(functools.reduce(pc.max_element_wise, longest)).to_pylist()


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


def write_shard(batch: pa.Table, *, output: str | None = None, storage_options: Mapping[str, Any] | None = None,
                footer: Callable[[pa.Table], Mapping[bytes, bytes]] | None = None,
                record: ShardRecord | None = None, store: tuple[Any, str] | None = None) -> pa.Table:
    """Commit one batch of finished rows as a Parquet shard with its record; return its ``ShardStats`` row.

    The shard goes to ``output`` (opened here with ``storage_options``) or to ``store``, an opened ``(fs, root)``.
    ``footer(rows)`` may add more key-value metadata to the shard's footer (the job adds quality counters).
    ``record`` is the rows' record when the caller built it already (``ShardRecord.of_rows`` with known hashes).
    """
    start = time.perf_counter()
    fs, dest = store if store is not None else open_fs(output, storage_options)
    shard = shard_id(batch.column("uri").to_pylist())
    rows = conform(batch, output_schema_like(batch.schema))
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

    A process, not a task a shard: once backpressure holds the fetch tasks' workers, each shard's task would start a
    Ray worker of its own, which spends far longer importing Ray Data and pyarrow than writing.
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


def write_json(fs: Any, dest: str, name: str, payload: Mapping[str, Any]) -> None:
    data = json.dumps(payload, indent=2, sort_keys=True, default=str).encode()
    path = f"{dest.rstrip('/')}/{name}"
    if is_local(fs):
        _write_then_rename(f"{dest.rstrip('/')}/.{name}.{uuid.uuid4().hex}.tmp", path, data, sync=False)
    else:
        fs.pipe_file(path, data)
