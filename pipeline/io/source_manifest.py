"""Sources that name their objects instead of being listed: a URI list (text, CSV or Parquet) and an S3 Inventory
``manifest.json`` (CSV.gz, Parquet or ORC data files), read a data file (or a Parquet row group) per unit.

A SOURCE of the form ``uris+URL`` is a URI list; ``inventory+s3://…/manifest.json`` an S3 Inventory. Their entries
are the listing's: ``(uri, size_bytes, etag, mtime_us)``, filtered by extension and ``--source-prefix``; a data file
that cannot be read is one ``list_error`` entry naming it, and the rest of the manifest is listed.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import unquote_plus

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import SourceError
from pipeline.io.keys import SCHEME, canonical_uri, object_uri
from pipeline.io.source_local import Entry, list_error
from pipeline.schema import MIB
from pipeline.storage import INVENTORY_FORM, is_local, missing_filesystem
from pipeline.text import BOM_BYTES, SAVE_AS, UTF8, decode_text, encoding_of, list_lines, open_text

URI_COLUMN = "uri"
# Optional columns of a URI list, by the names they may go by; with them, carry-over works as for a listing.
SIZE_COLUMNS = ("size_bytes", "size")
ETAG_COLUMNS = ("etag", "e_tag")
MTIME_COLUMNS = ("mtime", "last_modified", "last_modified_date")
READ_ROWS = 8192  # rows read from a data file at a time: memory stays flat whatever the manifest's size
INVENTORY_FORMATS = ("CSV", "Parquet", "ORC")
_TEXT_SUFFIXES = (".txt", ".txt.gz", ".lst")
_CSV_SUFFIXES = (".csv", ".csv.gz")
_SCHEME_PATTERN = f"^(?P<scheme>{SCHEME})://"  # a URI's scheme, as canonical_uri tells a URI from a path


def _norm(name: str) -> str:
    return name.lower().replace("_", "").replace(" ", "")


def _pick(names: list[str], choices: tuple[str, ...]) -> str | None:
    by_norm = {_norm(n): n for n in names}
    return next((by_norm[_norm(c)] for c in choices if _norm(c) in by_norm), None)


def extension_mask(keys: pa.Array, extensions: tuple[str, ...]) -> pa.Array:
    """Which keys a listing would list: a base name not starting with '.', ending in one of ``extensions``."""
    pattern = r"(?:^|/)[^./][^/]*\.(?:" + "|".join(re.escape(e) for e in extensions) + r")$"
    return pc.fill_null(pc.match_substring_regex(keys, pattern, ignore_case=True), False)


def prefix_uri(text: str) -> str:
    """``--source-prefix`` as the URIs it keeps begin: ``canonical_uri`` of it, ending in one ``/``, so that it
    matches whole path segments (``…/cam1`` and ``…/cam1/`` keep ``…/cam1/x.jpg``, never ``…/cam10/x.jpg``)."""
    return canonical_uri(text).rstrip("/") + "/"


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
    """Which ``uris`` are under ``prefix`` (``prefix_uri``'s) or are the object it names."""
    return None if not prefix else [u.startswith(prefix) or u == prefix[:-1] for u in uris]


def _unzipped(raw: Any) -> Any:
    """The file itself, or a gzip stream over it when it starts with gzip's magic bytes (whatever its name)."""
    magic = raw.read(2)
    raw.seek(0)
    return gzip.GzipFile(fileobj=raw) if magic == b"\x1f\x8b" else raw


# ---- URI lists ----

def _csv_batches(raw: Any, read_options: dict[str, Any], convert_options: Any) -> Iterator[pa.RecordBatch]:
    """The batches of a CSV file (gzip or not), in the encoding ``pipeline.text`` reads text in (pyarrow skips a
    UTF-8 byte-order mark itself and transcodes UTF-16 or UTF-32)."""
    import pyarrow.csv as pcsv

    stream = _unzipped(raw)
    head = stream.read(BOM_BYTES)
    if not head:  # an empty data file names no object (pyarrow would call it an error)
        return
    codec = encoding_of(head)
    stream.seek(0)
    options = pcsv.ReadOptions(block_size=MIB, use_threads=False, **read_options,
                               **({} if codec.startswith(UTF8) else {"encoding": codec}))
    try:
        yield from pcsv.open_csv(stream, read_options=options, convert_options=convert_options)
    except pa.ArrowInvalid as err:
        if "invalid UTF8" not in str(err):
            raise
        raise ValueError(f"it is not UTF-8 text ({err}); {SAVE_AS}") from None


def _uri_batches(fs: Any, path: str, row_groups: tuple[int, ...] | None = None,
                 columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """A URI list file's rows in batches: a text file's entries (``pipeline.text.list_lines``) as a ``uri`` column,
    a CSV's or Parquet file's columns (``columns``: only those of a Parquet file)."""
    lower = path.lower()
    if lower.endswith(_TEXT_SUFFIXES):
        with fs.open(path, "rb") as raw:
            lines: list[str] = []
            for line in list_lines(open_text(_unzipped(raw))):
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
            yield from _csv_batches(raw, {}, pcsv.ConvertOptions(strings_can_be_null=True))
        return
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        yield from pq.ParquetFile(f).iter_batches(batch_size=READ_ROWS, row_groups=row_groups, columns=columns)


def _uri_values(batch: pa.RecordBatch, extensions: tuple[str, ...]) -> tuple[pa.Array, pa.Array]:
    """A URI list batch's URIs as written, without the blanks around them, and which of them the listing keeps (not
    null, a listed extension)."""
    names = batch.schema.names
    column = _pick(names, (URI_COLUMN, "url"))
    if column is None:
        raise ValueError(f"no {URI_COLUMN!r} column (columns: {', '.join(names[:8])})")
    try:
        raw = pc.utf8_trim_whitespace(pc.cast(batch.column(column), pa.string()))
    except pa.ArrowInvalid as err:  # a CSV's column pyarrow read as bytes
        raise ValueError(f"its {column!r} column is not UTF-8 text ({err}); {SAVE_AS}") from None
    return raw, pc.and_(pc.is_valid(raw), extension_mask(raw, extensions))


def _uri_list_entries(batch: pa.RecordBatch, extensions: tuple[str, ...], prefix: str | None,
                      base: tuple[str, str]) -> list[Entry]:
    raw, keep = _uri_values(batch, extensions)
    rows = batch.filter(keep)
    uris = [canonical_uri(u, base) for u in raw.filter(keep).to_pylist()]
    names = batch.schema.names
    get = {k: rows.column(c) if (c := _pick(names, choices)) else None
           for k, choices in (("size", SIZE_COLUMNS), ("etag", ETAG_COLUMNS), ("mtime", MTIME_COLUMNS))}
    entries = _entries(uris, _ints(get["size"]), _strings(get["etag"]), _mtimes(get["mtime"]))
    mask = _prefix_mask(uris, prefix)
    return entries if mask is None else [e for e, m in zip(entries, mask) if m]


def _folder_of(url: str) -> tuple[str, str]:
    """(scheme, folder path) of the file at ``url`` (as fsspec names it: not percent-encoded)."""
    scheme, _, path = url.partition("://")
    return scheme, path.rsplit("/", 1)[0]


@dataclass(frozen=True)
class UriListFile:
    """One file of a URI list (``row_groups``: the Parquet row groups this unit reads; None: all of it)."""

    url: str
    prefix: str | None = None
    row_groups: tuple[int, ...] | None = None
    rows: int | None = field(default=None, compare=False)  # entries before filtering, when the footer says

    def entries(self, fs, extensions: tuple[str, ...], stat: bool) -> Iterator[Entry]:
        return _read_guarded(self.url, lambda: (
            _uri_list_entries(b, extensions, self.prefix, _folder_of(self.url))
            for b in _uri_batches(fs, fs._strip_protocol(self.url), self.row_groups)))


def unopenable_uris(fs: Any, path: str, extensions: tuple[str, ...], prefix: str | None = None
                    ) -> dict[str, tuple[str, str]]:
    """The schemes of the URIs a URI list (a file or a folder of them) names that no fsspec file system here opens,
    each with the first URI that names it and why (``pipeline.storage.missing_filesystem``), among the entries its
    listing keeps (extension, ``prefix``: ``prefix_uri``'s). A path without a scheme is on the list's own store or
    local, so it names none. Read in the driver before anything runs; a Parquet file whose footer statistics show
    one scheme that opens is not read; a file that cannot be read is left to its listing task (a ``list_error`` row).
    """
    import pyarrow.parquet as pq

    only = prefix.partition("://")[0] if prefix else None
    found: dict[str, str] = {}
    for file in _list_files(fs, path):
        try:
            columns = None
            if not file.lower().endswith(_TEXT_SUFFIXES + _CSV_SUFFIXES):
                with fs.open(file, "rb") as f:
                    parquet = pq.ParquetFile(f)
                    column = _pick(parquet.schema_arrow.names, (URI_COLUMN, "url"))
                    known = _footer_schemes(parquet.metadata, column)
                if column is None or (known is not None and not any(map(missing_filesystem, known))):
                    continue
                columns = [column]
            for batch in _uri_batches(fs, file, columns=columns):
                raw, keep = _uri_values(batch, extensions)
                kept = raw.filter(keep)
                schemes = pc.struct_field(pc.extract_regex(kept, _SCHEME_PATTERN), [0])
                for scheme in pc.unique(schemes).drop_null().to_pylist():
                    if scheme.lower() not in found and only in (None, scheme.lower()):
                        found[scheme.lower()] = kept[pc.index(schemes, scheme).as_py()].as_py()
        except Exception:  # noqa: BLE001 - the listing task reports it, as a row
            continue
    return {scheme: (uri, why) for scheme, uri in found.items() if (why := missing_filesystem(scheme))}


def _footer_schemes(meta: Any, column: str | None) -> set[str] | None:
    """The schemes of a Parquet URI list's ``column`` from its row groups' min and max: every value between two
    strings shares their common prefix, so where it holds ``scheme://`` every URI of the row group has that scheme.
    None where a row group's statistics do not tell (no statistics, or paths and URIs of several schemes)."""
    schemes: set[str] = set()
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        stats = next((group.column(c).statistics for c in range(group.num_columns)
                      if group.column(c).path_in_schema == column), None)
        if stats is None or not stats.has_min_max or not isinstance(stats.min, str):
            return None
        match = re.match(_SCHEME_PATTERN, os.path.commonprefix([stats.min, stats.max]))
        if match is None:
            return None
        schemes.add(match.group(1).lower())
    return schemes


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
            names = [_norm(c) for c in unit.columns]
            yield from _csv_batches(raw, {"column_names": names}, pcsv.ConvertOptions(
                column_types={n: pa.string() for n in names}, strings_can_be_null=True))
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
        scheme, _, path = url.partition("://")
        yield list_error(object_uri(scheme, path), f"cannot read this manifest data file: {text}; the objects it "
                                                   "names get rows on the run after it is fixed")


# ---- planning and checks (driver) ----

def _url_of(fs: Any, path: str) -> str:
    scheme, _, rest = fs.unstrip_protocol(path).partition("://")
    return f"{scheme}://{rest}"


@dataclass(frozen=True)
class InventoryManifest:
    """What the listing takes from an S3 Inventory ``manifest.json``: its data files' URLs, their format (one of
    INVENTORY_FORMATS) and CSV columns, and the bucket their keys are in."""

    fmt: str
    columns: tuple[str, ...]
    source_bucket: str
    urls: tuple[str, ...]


def _fields(value: Any) -> dict[str, Any]:
    """A JSON object's fields by their names in lower case (AWS writes ``key``, boto3's spelling is ``Key``)."""
    return {str(k).lower(): v for k, v in value.items()} if isinstance(value, dict) else {}


def _bucket(value: Any) -> str:
    """A bucket's name, also from its ARN (``arn:aws:s3:::bucket``, as ``destinationBucket`` holds it)."""
    return str(value or "").rsplit(":", 1)[-1].strip()


def read_inventory_manifest(fs: Any, path: str, url: str) -> InventoryManifest:
    """The ``manifest.json`` of an S3 Inventory report, read whole and checked in the driver: as AWS writes it
    (``files`` of ``{"key": …}``) or by hand (field names in any case, ``"Key"``, ``files`` as plain keys; a
    byte-order mark). A field the listing needs that is missing or malformed fails in one line naming it."""
    try:
        text = decode_text(fs.cat_file(path))
    except ValueError as err:
        raise SourceError(f"manifest.json {url!r}: {err}") from None
    try:
        fields = _fields(json.loads(text))
    except ValueError as err:
        raise SourceError(f"{url!r} is not JSON ({err}); give the manifest.json of an S3 Inventory report") from None
    fmt = {f.lower(): f for f in INVENTORY_FORMATS}.get(str(fields.get("fileformat")).lower())
    files = fields.get("files")
    if fmt is None or not isinstance(files, list):
        raise SourceError(f"{url!r} is not an S3 Inventory manifest (fileFormat {fields.get('fileformat')!r}, files);"
                          f" give the manifest.json of a report in {', '.join(INVENTORY_FORMATS)} format")
    keys = []
    for i, entry in enumerate(files):
        key = entry if isinstance(entry, str) else _fields(entry).get("key")
        if not isinstance(key, str) or not key.strip():
            what = f"fields {', '.join(map(str, entry))}" if isinstance(entry, dict) else f"{entry!r}"
            raise SourceError(f"manifest.json {url!r}: files[{i}] ({what[:80]}) names no data file; give each as "
                              '{"key": "KEY"} (S3 Inventory\'s own form) or as the key itself')
        keys.append(key.strip())
    dest = _bucket(fields.get("destinationbucket")) or ("" if is_local(fs) else path.split("/", 1)[0])
    if not dest:
        raise SourceError(f"manifest.json {url!r}: no destinationBucket, the bucket its data files are in; add "
                          '"destinationBucket": "arn:aws:s3:::BUCKET"')
    schema = fields.get("fileschema")
    columns = tuple(c.strip() for c in schema.split(",")) if isinstance(schema, str) else ()
    source_bucket = _bucket(fields.get("sourcebucket"))
    if fmt == "CSV" and "key" not in map(_norm, columns):
        raise SourceError(f"manifest.json {url!r}: fileSchema {schema!r} names no Key column; a CSV report's data "
                          'files have no header, so fileSchema lists their columns, e.g. "Bucket, Key, Size"')
    if fmt == "CSV" and not source_bucket and "bucket" not in map(_norm, columns):
        raise SourceError(f"manifest.json {url!r}: no sourceBucket, and no Bucket column in fileSchema, so its keys "
                          'name no bucket; add "sourceBucket": "BUCKET"')
    return InventoryManifest(fmt, columns, source_bucket, tuple(f"s3://{dest}/{k}" for k in keys))


def _list_files(fs: Any, path: str) -> list[str]:
    """The files of a URI list: the file itself, or a folder's files but those named ``.*`` or ``_*``."""
    if fs.isdir(path):
        return sorted(p for p in fs.find(path) if not p.rsplit("/", 1)[-1].startswith((".", "_")))
    return [path]


def plan_manifest(fs: Any, form: str, path: str, url: str, prefix: str | None = None) -> list:
    """The units of a manifest SOURCE: one per data file (per row group of a lone Parquet URI list)."""
    if form == INVENTORY_FORM:
        manifest = read_inventory_manifest(fs, path, url)
        rows = _footer_rows(fs, list(manifest.urls), manifest.fmt)
        return [InventoryFile(u, manifest.fmt, manifest.columns, manifest.source_bucket, prefix, n)
                for u, n in zip(manifest.urls, rows)]
    files = _list_files(fs, path)
    if files == [path] and path.lower().endswith((".parquet", ".pq")):
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
        return [UriListFile(_url_of(fs, path), prefix, (g,), meta.row_group(g).num_rows)
                for g in range(meta.num_row_groups)]
    return [UriListFile(_url_of(fs, p), prefix) for p in files]


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
