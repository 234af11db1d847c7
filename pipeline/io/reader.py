"""Reading output back: the committed shards of DEST, their footers and records, a few of their columns, and the
JSON bookkeeping files that ``pipeline.io.writer`` writes."""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.columns import conform, output_schema_like
from pipeline.io.writer import ShardRecord
from pipeline.schema import GROUP_CHARS, OUTPUT_SCHEMA, PART_PREFIX, PART_SUFFIX, RECORD_KEY, SHARD_META_KEY
from pipeline.storage import is_local

LOG = logging.getLogger(__name__)
GROUP_RE = re.compile(rf"^[0-9a-f]{{{GROUP_CHARS}}}$")
FOOTER_READERS = 16  # concurrent footer reads on object stores


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
    columns = ["uri", "status", "class_ids", "model", "model_digest", "carried", "etag", "size_bytes", "mtime"]
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
    table = table.replace_schema_metadata(None)
    return conform(table, output_schema_like(table.schema)), (
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


def read_json(fs: Any, dest: str, name: str) -> dict[str, Any] | None:
    path = f"{dest.rstrip('/')}/{name}"
    try:
        return json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:
        LOG.warning("%s is not JSON; ignored", path)
        return None
