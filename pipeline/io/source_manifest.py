"""Sources that name their objects instead of being listed: a URI list (text, CSV or Parquet) and an S3 Inventory
``manifest.json`` (CSV.gz, Parquet or ORC data files), read a data file (or a Parquet row group) per unit.

A SOURCE of the form ``uris+URL`` is a URI list; ``inventory+s3://…/manifest.json`` an S3 Inventory. Their entries
are the listing's: ``(uri, size_bytes, etag, mtime_us)``, filtered by extension and ``--source-prefix``; a data file
that cannot be read is one ``list_error`` entry naming it, and the rest of the manifest is listed.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import unquote_plus

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import SourceError
from pipeline.io.keys import object_uri, uri_path
from pipeline.io.source_local import Entry, list_error
from pipeline.schema import MIB
from pipeline.storage import INVENTORY_FORM

URI_COLUMN = "uri"
# Optional columns of a URI list, by the names they may go by; with them, carry-over works as for a listing.
SIZE_COLUMNS = ("size_bytes", "size")
ETAG_COLUMNS = ("etag", "e_tag")
MTIME_COLUMNS = ("mtime", "last_modified", "last_modified_date")
READ_ROWS = 8192  # rows read from a data file at a time: memory stays flat whatever the manifest's size
INVENTORY_FORMATS = ("CSV", "Parquet", "ORC")
_TEXT_SUFFIXES = (".txt", ".txt.gz", ".lst")
_CSV_SUFFIXES = (".csv", ".csv.gz")


def _norm(name: str) -> str:
    return name.lower().replace("_", "").replace(" ", "")


def _pick(names: list[str], choices: tuple[str, ...]) -> str | None:
    by_norm = {_norm(n): n for n in names}
    return next((by_norm[_norm(c)] for c in choices if _norm(c) in by_norm), None)


def extension_mask(keys: pa.Array, extensions: tuple[str, ...]) -> pa.Array:
    """Which keys a listing would list: a base name not starting with '.', ending in one of ``extensions``."""
    pattern = r"(?:^|/)[^./][^/]*\.(?:" + "|".join(re.escape(e) for e in extensions) + r")$"
    return pc.fill_null(pc.match_substring_regex(keys, pattern, ignore_case=True), False)


def canonical_uri(text: str, base: str | None = None) -> str:
    """A URI as the output writes it (percent-encoded path). Without a scheme: a local path if absolute, else a
    path relative to ``base`` (the URL of the list's folder)."""
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if sep and scheme != "file" and "%" not in rest:  # nothing to decode: encode it as is (the common case)
        return object_uri(scheme, rest)
    if not sep:
        if text.startswith("/") or base is None:
            return object_uri("file", os.path.abspath(text))
        text = f"{base.rstrip('/')}/{text}"
    return object_uri(*uri_path_parts(text))


def uri_path_parts(uri: str) -> tuple[str, str]:
    """(scheme, decoded path) of a URI; a local path is normalised (``..`` resolved), as a listing would name it."""
    scheme = uri.partition("://")[0]
    path = uri_path(uri)
    return scheme, os.path.normpath(path) if scheme == "file" else path


def _mtimes(column: pa.ChunkedArray | pa.Array | None) -> list:
    if column is None:
        return []
    if pa.types.is_timestamp(column.type):
        return pc.cast(column.cast(pa.timestamp("us", tz=column.type.tz or "UTC")), pa.int64()).to_pylist()
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        # S3 Inventory writes 2026-12-01T05:10:44.000Z; strptime keeps the milliseconds
        parsed = pc.strptime(pc.replace_substring_regex(column, r"(\.\d+)?Z$", ""), "%Y-%m-%dT%H:%M:%S", "us",
                             error_is_null=True)
        return pc.cast(parsed, pa.int64()).to_pylist()
    return pc.cast(column, pa.int64()).to_pylist()


def _ints(column: Any) -> list:
    return [] if column is None else pc.cast(column, pa.int64(), safe=False).to_pylist()


def _strings(column: Any) -> list:
    if column is None:
        return []
    return [None if e is None else e.strip('"') or None for e in pc.cast(column, pa.string()).to_pylist()]


def _entries(uris: list[str], sizes: list, etags: list, mtimes: list) -> list[Entry]:
    n = len(uris)
    return list(zip(uris, sizes or [None] * n, etags or [None] * n, mtimes or [None] * n))


def _prefix_mask(uris: list[str], prefix: str | None) -> list[bool] | None:
    return None if not prefix else [u.startswith(prefix) for u in uris]


def _unzipped(raw: Any) -> Any:
    """The file itself, or a gzip stream over it when it starts with gzip's magic bytes (whatever its name)."""
    magic = raw.read(2)
    raw.seek(0)
    return gzip.GzipFile(fileobj=raw) if magic == b"\x1f\x8b" else raw


# ---- URI lists ----

def _uri_batches(fs: Any, path: str, row_groups: tuple[int, ...] | None) -> Iterator[pa.RecordBatch]:
    lower = path.lower()
    if lower.endswith(_TEXT_SUFFIXES):
        with fs.open(path, "rb") as raw:
            stream = _unzipped(raw)
            lines: list[str] = []
            for line in io.TextIOWrapper(stream, encoding="utf-8"):
                line = line.strip()
                if line and not line.startswith("#"):
                    lines.append(line)
                if len(lines) >= READ_ROWS:
                    yield pa.record_batch([pa.array(lines, pa.string())], names=[URI_COLUMN])
                    lines = []
            if lines:
                yield pa.record_batch([pa.array(lines, pa.string())], names=[URI_COLUMN])
        return
    if lower.endswith(_CSV_SUFFIXES):
        import pyarrow.csv as pcsv

        with fs.open(path, "rb") as raw:
            stream = _unzipped(raw)
            reader = pcsv.open_csv(stream, read_options=pcsv.ReadOptions(block_size=MIB, use_threads=False),
                                   convert_options=pcsv.ConvertOptions(strings_can_be_null=True))
            yield from reader
        return
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        yield from pq.ParquetFile(f).iter_batches(batch_size=READ_ROWS, row_groups=row_groups)


def _uri_list_entries(batch: pa.RecordBatch, extensions: tuple[str, ...], prefix: str | None,
                      base: str) -> list[Entry]:
    names = batch.schema.names
    column = _pick(names, (URI_COLUMN, "url"))
    if column is None:
        raise ValueError(f"no {URI_COLUMN!r} column (columns: {', '.join(names[:8])})")
    raw = pc.cast(batch.column(column), pa.string())
    keep = pc.and_(pc.is_valid(raw), extension_mask(raw, extensions))
    rows = batch.filter(keep)
    uris = [canonical_uri(u, base) for u in pc.cast(rows.column(column), pa.string()).to_pylist()]
    get = {k: rows.column(c) if (c := _pick(names, choices)) else None
           for k, choices in (("size", SIZE_COLUMNS), ("etag", ETAG_COLUMNS), ("mtime", MTIME_COLUMNS))}
    entries = _entries(uris, _ints(get["size"]), _strings(get["etag"]), _mtimes(get["mtime"]))
    mask = _prefix_mask(uris, prefix)
    return entries if mask is None else [e for e, m in zip(entries, mask) if m]


@dataclass(frozen=True)
class UriListFile:
    """One file of a URI list (``row_groups``: the Parquet row groups this unit reads; None: all of it)."""

    url: str
    prefix: str | None = None
    row_groups: tuple[int, ...] | None = None
    rows: int | None = field(default=None, compare=False)  # entries before filtering, when the footer says

    def entries(self, fs, extensions: tuple[str, ...], stat: bool) -> Iterator[Entry]:
        return _read_guarded(self.url, lambda: (
            _uri_list_entries(b, extensions, self.prefix, self.url.rsplit("/", 1)[0])
            for b in _uri_batches(fs, fs._strip_protocol(self.url), self.row_groups)))


# ---- S3 Inventory ----

@dataclass(frozen=True)
class InventoryFile:
    """One data file of an S3 Inventory report: ``fmt`` one of INVENTORY_FORMATS, ``columns`` the CSV's columns
    (from the manifest's ``fileSchema``; Parquet and ORC files name their own)."""

    url: str
    fmt: str
    columns: tuple[str, ...]
    bucket: str
    prefix: str | None = None
    rows: int | None = field(default=None, compare=False)

    def entries(self, fs, extensions: tuple[str, ...], stat: bool) -> Iterator[Entry]:
        return _read_guarded(self.url, lambda: (
            _inventory_entries(b, self, extensions) for b in _inventory_batches(fs, self)))


def _inventory_batches(fs: Any, unit: InventoryFile) -> Iterator[pa.RecordBatch]:
    path = fs._strip_protocol(unit.url)
    if unit.fmt == "CSV":
        import pyarrow.csv as pcsv

        with fs.open(path, "rb") as raw:
            stream = _unzipped(raw)
            names = [_norm(c) for c in unit.columns]
            reader = pcsv.open_csv(
                stream, read_options=pcsv.ReadOptions(column_names=names, block_size=MIB, use_threads=False),
                convert_options=pcsv.ConvertOptions(column_types={n: pa.string() for n in names},
                                                    strings_can_be_null=True))
            yield from reader
        return
    with fs.open(path, "rb") as f:
        if unit.fmt == "Parquet":
            import pyarrow.parquet as pq

            yield from pq.ParquetFile(f).iter_batches(batch_size=READ_ROWS)
        else:
            import pyarrow.orc as po

            orc = po.ORCFile(f)
            for stripe in range(orc.nstripes):
                yield orc.read_stripe(stripe)


def _flag(batch: pa.RecordBatch, name: str | None) -> pa.Array | None:
    """An inventory's true/false column (CSV: text) as booleans; None where the report has no such column."""
    if name is None:
        return None
    col = batch.column(name)
    if pa.types.is_boolean(col.type):
        return col
    return pc.equal(pc.utf8_lower(pc.cast(col, pa.string())), "true")


def _inventory_entries(batch: pa.RecordBatch, unit: InventoryFile, extensions: tuple[str, ...]) -> list[Entry]:
    names = [_norm(n) for n in batch.schema.names]
    batch = pa.RecordBatch.from_arrays(batch.columns, names=names)
    if "key" not in names:
        raise ValueError(f"no Key column (columns: {', '.join(names[:8])})")
    keys = pc.cast(batch.column("key"), pa.string())
    if unit.fmt == "CSV":  # CSV reports hold keys URL-encoded ('+' for a space)
        keys = pa.array([k if k is None or ("%" not in k and "+" not in k) else unquote_plus(k)
                         for k in keys.to_pylist()], pa.string())
    keep = pc.and_(pc.is_valid(keys), extension_mask(keys, extensions))
    latest, deleted = _flag(batch, "islatest" if "islatest" in names else None), \
        _flag(batch, "isdeletemarker" if "isdeletemarker" in names else None)
    if latest is not None:  # a non-latest version is not the object a reader gets
        keep = pc.and_(keep, pc.fill_null(latest, True))
    if deleted is not None:  # a delete marker names an object that is gone
        keep = pc.and_(keep, pc.invert(pc.fill_null(deleted, False)))
    rows = batch.filter(keep)
    keys = keys.filter(keep).to_pylist()
    buckets = (pc.cast(rows.column("bucket"), pa.string()).to_pylist() if "bucket" in names
               else [unit.bucket] * len(keys))
    uris = [object_uri("s3", f"{b or unit.bucket}/{k}") for b, k in zip(buckets, keys)]
    entries = _entries(uris, _ints(rows.column("size") if "size" in names else None),
                       _strings(rows.column("etag") if "etag" in names else None),
                       _mtimes(rows.column("lastmodifieddate") if "lastmodifieddate" in names else None))
    mask = _prefix_mask(uris, unit.prefix)
    return entries if mask is None else [e for e, m in zip(entries, mask) if m]


def _read_guarded(url: str, blocks: Any) -> Iterator[Entry]:
    """The entries of a data file's blocks; a file that cannot be read (at its start or part-way) ends with one
    ``list_error`` entry naming it, and the other data files are listed as usual."""
    try:
        for block in blocks():
            yield from block
    except Exception as err:  # noqa: BLE001 - any failure of one data file is that file's row
        text = f"{type(err).__name__}: {err}".replace("\n", " ")[:300]
        yield list_error(url, f"cannot read this manifest data file: {text}; the objects it names get rows on the "
                              "run after it is fixed")


# ---- planning and checks (driver) ----

def _url_of(fs: Any, path: str) -> str:
    scheme, _, rest = fs.unstrip_protocol(path).partition("://")
    return f"{scheme}://{rest}"


def read_inventory_manifest(fs: Any, path: str, url: str) -> dict[str, Any]:
    """The parsed ``manifest.json`` of an S3 Inventory report, checked for the fields this reader needs."""
    try:
        manifest = json.loads(fs.cat_file(path))
    except ValueError as err:
        raise SourceError(f"{url!r} is not JSON ({err}); give the manifest.json of an S3 Inventory report") from None
    fmt = manifest.get("fileFormat") if isinstance(manifest, dict) else None
    canonical = {f.lower(): f for f in INVENTORY_FORMATS}.get(str(fmt).lower())
    if canonical is None or not isinstance(manifest.get("files"), list):
        raise SourceError(f"{url!r} is not an S3 Inventory manifest (fileFormat {fmt!r}, files); give the "
                          f"manifest.json of a report in {', '.join(INVENTORY_FORMATS)} format")
    manifest["fileFormat"] = canonical
    return manifest


def plan_manifest(fs: Any, form: str, path: str, url: str, prefix: str | None = None) -> list:
    """The units of a manifest SOURCE: one per data file (per row group of a lone Parquet URI list)."""
    if form == INVENTORY_FORM:
        manifest = read_inventory_manifest(fs, path, url)
        dest = str(manifest.get("destinationBucket") or "").rsplit(":", 1)[-1] or path.split("/", 1)[0]
        columns = tuple(c.strip() for c in str(manifest.get("fileSchema") or "").split(","))
        source_bucket = str(manifest.get("sourceBucket") or "")
        urls = [f"s3://{dest}/{f['key']}" for f in manifest["files"]]
        rows = _footer_rows(fs, urls, manifest["fileFormat"])
        return [InventoryFile(u, manifest["fileFormat"], columns, source_bucket, prefix, n) for u, n in zip(urls, rows)]
    if fs.isdir(path):
        files = sorted(p for p in fs.find(path) if not p.rsplit("/", 1)[-1].startswith((".", "_")))
        return [UriListFile(_url_of(fs, p), prefix) for p in files]
    if path.lower().endswith((".parquet", ".pq")):
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        return [UriListFile(_url_of(fs, path), prefix, (g,), meta.row_group(g).num_rows)
                for g in range(meta.num_row_groups)]
    return [UriListFile(_url_of(fs, path), prefix)]


def _footer_rows(fs: Any, urls: list[str], fmt: str) -> list[int | None]:
    """Rows of each Parquet or ORC data file from its footer, read concurrently (CSV: unknown, None each); a file
    whose footer cannot be read is None here and a ``list_error`` row when it is listed."""
    if fmt == "CSV":
        return [None] * len(urls)
    from concurrent.futures import ThreadPoolExecutor

    def rows(url: str) -> int | None:
        try:
            with fs.open(fs._strip_protocol(url), "rb") as f:
                if fmt == "Parquet":
                    import pyarrow.parquet as pq

                    return pq.ParquetFile(f).metadata.num_rows
                import pyarrow.orc as po

                return po.ORCFile(f).nrows
        except Exception:  # noqa: BLE001 - the listing task reports it, as a row
            return None

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(rows, urls))


def planned_entries(groups: list[list]) -> int | None:
    """Entries a manifest's plan names before filtering, when every unit knows its count from a footer."""
    counts = [getattr(unit, "rows", None) for group in groups for unit in group]
    return sum(counts) if counts and None not in counts else None
