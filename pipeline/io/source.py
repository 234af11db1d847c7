"""Listing the source: recursive, extension-filtered, split into key ranges that tasks list in parallel.

Plain functions the job's Ray tasks call; Ray itself is touched only to fetch the done/carried key sets those tasks
are handed as object refs (``resolve_keys``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterator, Mapping

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import EmptySourceError, SourceError
from pipeline.io.keys import done_mask, identity_hashes, member, object_uri
from pipeline.io.source_local import (
    Claim, Entry, is_error, list_error, local_files, os_error_text, stat_local, walk_local,
)
from pipeline.io.source_manifest import (
    InventoryFile, UriListFile, plan_manifest, prefix_uri, read_inventory_manifest, unopenable_uris,
)
from pipeline.schema import LISTING_SCHEMA, STATUS_ERROR
from pipeline.storage import INVENTORY_FORM, is_local, manifest_form, storage_failure

LOG = logging.getLogger(__name__)
BLOCK_ROWS = 1000  # rows per listing block: small enough that classification starts early
# Rows to classify are held back until this many (or FRESH_WAIT_S, or the end): when almost everything is done
# or carried, 1,000 listed objects hold a handful of new ones, and a block each would mean a task each downstream.
FRESH_BLOCK_ROWS = 256
FRESH_WAIT_S = 2.0
LOCAL_SPLIT_FILES = 20_000  # a local folder with more files than this directly in it is listed by several tasks
S3_PAGE = 1000  # keys per LIST call (the S3 maximum)
S3_MAX_PROBES = 512  # LIST calls the planner may spend finding split points in one flat prefix
S3_RANGES_PER_TASK = 4  # key ranges planned per listing task, so uneven ranges even out
MAX_CHAR = "\U0010ffff"  # sorts after every character a key can hold next (S3 orders keys by UTF-8 bytes)
CARRY_FLUSH = 100_000  # carried identities a listing task sends to the counter at once
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def check_source(fs: fsspec.AbstractFileSystem, root: str, url: str, extensions: tuple[str, ...] | None = None,
                 *, follow_symlinks: bool = False, source_prefix: str | None = None) -> None:
    """Fail before any work when the source is missing, unlistable or unreachable, or (``extensions``) empty; a
    manifest also when it is malformed or names objects on a store no file system here opens (``check_manifest``)."""
    form = manifest_form(url)
    if form is not None:
        return check_manifest(fs, form[0], root, url, extensions, source_prefix)
    try:
        exists = fs.exists(root)
        kind = fs.info(root).get("type") if exists else None
        if kind == "directory" and is_local(fs):
            os.scandir(root).close()  # a folder that stat can see but not list (mode 000)
        empty = kind == "directory" and extensions and not _holds_any(fs, root, extensions, follow_symlinks)
    except Exception as err:  # noqa: BLE001 - any storage failure here is the user's to fix
        raise SourceError(storage_failure(url, err)) from None
    if not exists:
        raise SourceError(f"source {url!r} does not exist; check the path or bucket prefix")
    if kind != "directory":
        raise SourceError(f"source {url!r} is a {kind}, not a folder or prefix; give the folder that holds the images")
    if empty:
        raise EmptySourceError(f"source {url!r} holds no file with extension {','.join(extensions)}: nothing to "
                               "classify; check SOURCE and --extensions")


def check_manifest(fs: fsspec.AbstractFileSystem, form: str, path: str, url: str,
                   extensions: tuple[str, ...] | None = None, source_prefix: str | None = None) -> None:
    """Fail before any work when a manifest SOURCE is missing or not a manifest (a ``manifest.json`` is checked
    whole), or (``extensions``) when a URI list names objects whose scheme no fsspec file system here opens: one line
    naming the package to install. Its data files are read in the listing tasks: one that cannot be read is a
    ``list_error`` row."""
    inventory = form == INVENTORY_FORM
    try:
        exists = fs.exists(path)
        if exists and inventory:
            read_inventory_manifest(fs, path, url)
        unopenable = unopenable_uris(fs, path, extensions, prefix_uri(source_prefix) if source_prefix else None) \
            if exists and not inventory and extensions else {}
    except SourceError:
        raise
    except Exception as err:  # noqa: BLE001 - any storage failure here is the user's to fix
        raise SourceError(storage_failure(url, err)) from None
    if not exists:
        what = "manifest.json" if inventory else "URI list"
        raise SourceError(f"{what} {url!r} does not exist; check the URL after {form!r}")
    if inventory and not _is_s3(fs):
        raise SourceError(f"manifest.json {url!r} is not on S3: an S3 Inventory report is read where S3 delivered it, "
                          "its data files from its destinationBucket; give inventory+s3://BUCKET/…/manifest.json")
    for scheme, (example, missing) in unopenable.items():
        raise SourceError(f"URI list {url!r} names {scheme}:// objects ({example[:100]!r}) but no fsspec file "
                          f"system for {scheme}:// is installed here ({missing}); install it, or leave those lines "
                          "out (--source-prefix keeps one store's)")


def _holds_any(fs: fsspec.AbstractFileSystem, root: str, extensions: tuple[str, ...], follow: bool) -> bool:
    """Whether the listing of ``root`` gives an entry (a file or a list_error row); it stops at the first."""
    unit: Unit | None = LocalDir(root, root, follow) if is_local(fs) else FsDir(root)
    if _is_s3(fs):
        bucket, prefix = _s3_split(root)
        first = (_list_page(fs, bucket, prefix, max_keys=1).get("Contents") or [None])[0]
        unit = S3Range(bucket, prefix, first, None) if first else None
    return unit is not None and next(iter(list_unit(fs, unit, extensions, stat=False)), None) is not None


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


def matches(name: str, extensions: tuple[str, ...]) -> bool:
    base = name.rsplit("/", 1)[-1]
    if base.startswith("."):
        return False
    _, dot, ext = base.rpartition(".")
    return bool(dot) and ext.lower() in extensions


def fsspec_entry(fs: fsspec.AbstractFileSystem, info: Mapping[str, Any]) -> Entry:
    etag = info.get("ETag") or info.get("etag")
    stamp = mtime_us(info.get("LastModified") or info.get("mtime") or info.get("last_modified"))
    scheme, _, path = fs.unstrip_protocol(info["name"]).partition("://")
    return (object_uri(scheme, path), int(info.get("size") or 0), str(etag).strip('"') if etag else None, stamp)


# ---- planning: which key ranges each listing task takes (runs where Ray Data plans the read) ----

def plan_listing(fs: fsspec.AbstractFileSystem, root: str, extensions: tuple[str, ...], tasks: int, *,
                 follow_symlinks: bool = False, source: str | None = None, source_prefix: str | None = None
                 ) -> list[list[Unit]]:
    """Split the listing of ``root`` into up to ``tasks`` groups of units; each unit lists a disjoint part.

    Local folders: sub-folders are spread over the tasks; the files and links directly in a large folder are split
    by a hash of their names. S3: the key space of the prefix is split at real keys found by probing the characters
    after the prefix with ``StartAfter`` (nested or flat alike). Other fsspec stores: sub-prefixes, as before.
    A manifest ``source`` (``pipeline.io.source_manifest``): its data files, with ``source_prefix`` (a URI prefix).
    """
    tasks = max(1, tasks)
    form = manifest_form(source or "")
    if form is not None:  # a manifest: one unit per data file, however its objects are stored
        units = plan_manifest(fs, form[0], root, form[1], prefix_uri(source_prefix) if source_prefix else None)
    elif is_local(fs):
        units = _plan_local(root, tasks, follow_symlinks)
    elif _is_s3(fs):
        units = _plan_s3(fs, root, tasks)
    else:
        units = _plan_fsspec(fs, root, extensions)
    groups: list[list[Unit]] = [[] for _ in range(max(1, min(tasks, len(units))))]
    for i, unit in enumerate(units):
        groups[i % len(groups)].append(unit)
    return groups


def _plan_local(root: str, tasks: int, follow: bool) -> list[Unit]:
    dirs, files = [], 0
    with os.scandir(root) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):  # a link to a folder is the local_files units' to judge
                dirs.append(entry.path)
            else:
                files += 1
    units: list[Unit] = [LocalDir(d, root, follow) for d in sorted(dirs)]
    split = max(1, min(tasks, -(-files // LOCAL_SPLIT_FILES)))
    units += [LocalFiles(root, i, split, follow) for i in range(split)] if files else []
    return units


def _plan_fsspec(fs: fsspec.AbstractFileSystem, root: str, extensions: tuple[str, ...]) -> list[Unit]:
    entries = sorted(fs.ls(root, detail=True), key=lambda e: e["name"])
    files = [e for e in entries if e.get("type") == "file" and matches(e["name"], extensions)]
    dirs = [e["name"] for e in entries if e.get("type") == "directory" and e["name"].rstrip("/") != root.rstrip("/")]
    return [FsDir(d) for d in dirs] + ([FsFiles(files)] if files else [])


def _is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocols and hasattr(fs, "call_s3")


def _s3_split(root: str) -> tuple[str, str]:
    bucket, _, key = root.strip("/").partition("/")
    return bucket, (key.rstrip("/") + "/" if key else "")


def _list_page(fs: Any, bucket: str, prefix: str, start_after: str | None = None, max_keys: int | None = None,
               token: str | None = None) -> dict:
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": max_keys or S3_PAGE}
    if start_after is not None:
        kwargs["StartAfter"] = start_after
    if token is not None:
        kwargs["ContinuationToken"] = token
    return fs.call_s3("list_objects_v2", **kwargs)


class _Prober:
    """Finds the first key at or after a point of a prefix's key space, one 1-key LIST call at a time."""

    def __init__(self, fs: Any, bucket: str):
        self.fs, self.bucket, self.calls = fs, bucket, 0
        self._seen: dict[tuple[str, str | None], dict | None] = {}

    def first(self, prefix: str, start_after: str | None) -> dict | None:
        if (prefix, start_after) not in self._seen:
            self.calls += 1
            contents = _list_page(self.fs, self.bucket, prefix, start_after, max_keys=1).get("Contents") or []
            self._seen[prefix, start_after] = contents[0] if contents else None
        return self._seen[prefix, start_after]

    def common(self, q: str, first: dict) -> str:
        """The longest prefix that every key under ``q`` shares (a binary search over the first key's length).

        A one-child chain (``img`` -> ``img0`` -> ``img00`` ...) would cost two probes a character otherwise.
        """
        key = first["Key"]
        second = self.first(q, key)
        if second is None:  # one key under q
            return key
        lo, hi = len(q), len(os.path.commonprefix([key, second["Key"]]))  # the first two keys bound it
        while lo < hi and self.calls < S3_MAX_PROBES:
            mid = (lo + hi + 1) // 2
            if self.first(q, key[:mid] + MAX_CHAR) is None:  # nothing under q after the block key[:mid]...
                lo = mid
            else:
                hi = mid - 1
        return key[:lo]

    def children(self, q: str, first: dict) -> list[tuple[str, dict]]:
        """(q + next character, first key under it) for every character that follows ``q`` in some key."""
        out: list[tuple[str, dict]] = []
        entry: dict | None = first
        while entry is not None and self.calls < S3_MAX_PROBES:
            key = entry["Key"]
            if len(key) == len(q):  # the prefix itself is a key: it is its own range start
                out.append((key + "\0", entry))
                entry = self.first(q, key)
                continue
            child = q + key[len(q)]
            if out and out[-1][0] == child:  # a key beyond MAX_CHAR: take it as is, move on
                entry = self.first(q, key)
                continue
            out.append((child, entry))
            entry = self.first(q, child + MAX_CHAR)
        return out  # out of probes, the keys left stay in the last child's range


def _plan_s3(fs: Any, root: str, tasks: int) -> list[Unit]:
    bucket, prefix = _s3_split(root)
    page = _list_page(fs, bucket, prefix)
    contents = page.get("Contents") or []
    if not page.get("IsTruncated"):
        return [S3Keys(bucket, contents)] if contents else []
    if tasks == 1:  # one task lists it all in order: nothing to probe
        return [S3Range(bucket, prefix, contents[0], None)]
    prober = _Prober(fs, bucket)
    leaves: list[tuple[str, dict]] = [(prefix, contents[0])]
    target = tasks * S3_RANGES_PER_TASK
    for _depth in range(256):
        if len(leaves) >= target or prober.calls >= S3_MAX_PROBES:
            break
        grown: list[tuple[str, dict]] = []
        for i, (q, first) in enumerate(leaves):
            # Split leaves one level deeper only until there are enough: every probe is a LIST call (a full scan
            # of the bucket on moto), and splitting all of them at each level cost hundreds of probes.
            # A q ending in NUL is finished: a key that is its own range. A key equal to q (a folder marker such
            # as "photos/") is no reason to stop: children() gives it its own range and splits the rest.
            if q.endswith("\0") or prober.calls >= S3_MAX_PROBES or len(grown) + len(leaves) - i >= target:
                grown.append((q, first))
                continue
            shared = prober.common(q, first)
            if shared == first["Key"] and prober.first(q, shared) is None:  # one key under q: nothing to split
                grown.append((shared + "\0", first))
            else:
                grown.extend(prober.children(shared, first))
        if [q for q, _ in grown] == [q for q, _ in leaves]:
            break
        leaves = grown
    starts = sorted({first["Key"]: first for _q, first in leaves}.values(), key=lambda e: e["Key"])
    LOG.info("listing s3://%s/%s in %d key ranges (%d probe calls)", bucket, prefix, len(starts), prober.calls)
    return [S3Range(bucket, prefix, start, starts[i + 1]["Key"] if i + 1 < len(starts) else None)
            for i, start in enumerate(starts)]


# ---- listing one unit (runs in the read task) ----

def _s3_entry(bucket: str, item: Mapping[str, Any]) -> Entry:
    etag = item.get("ETag")
    return (object_uri("s3", f"{bucket}/{item['Key']}"), int(item.get("Size") or 0),
            str(etag).strip('"') if etag else None, mtime_us(item.get("LastModified")))


def _s3_range(fs: Any, bucket: str, prefix: str, start: dict, stop: str | None,
              extensions: tuple[str, ...]) -> Iterator[Entry]:
    """Keys in [start, stop): the start key itself (found by the planner), then LIST pages after it."""
    if matches(start["Key"], extensions):
        yield _s3_entry(bucket, start)
    if stop is not None:  # every key in [start, stop) shares their common prefix: a narrower LIST, same keys
        prefix = os.path.commonprefix([start["Key"], stop])
    token, last = None, start["Key"]
    while True:
        try:
            page = _list_page(fs, bucket, prefix, None if token else start["Key"], token=token)
        except Exception as err:  # noqa: BLE001 - after the client's retries: the rest of the range is a row
            text = f"{type(err).__name__}: {err}".replace("\n", " ")[:300]
            # Named after the last key listed (and ending in '/', as no object it names): ranges are disjoint, so
            # two ranges that fail under one prefix give two rows, not one URI twice.
            yield list_error(object_uri("s3", f"{bucket}/{last}/"), f"cannot list the keys after {last!r} under "
                             f"{object_uri('s3', f'{bucket}/{prefix}')}: {text}; they get rows on the next run")
            return
        for item in page.get("Contents") or []:
            last = item["Key"]
            if stop is not None and item["Key"] >= stop:
                return
            if matches(item["Key"], extensions):
                yield _s3_entry(bucket, item)
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return


# ---- listing units: what one planned part of the listing covers, and how it lists itself ----

@dataclass(frozen=True)
class LocalDir:
    """A local sub-folder of the source (``root``), walked recursively."""

    path: str
    root: str
    follow: bool
    claim: Claim | None = field(default=None, compare=False, repr=False)  # set in the listing task

    def entries(self, fs, extensions: tuple[str, ...], stat: bool) -> Iterator[Entry]:
        return walk_local(self.path, extensions, stat, root=self.root, follow=self.follow, claim=self.claim)


@dataclass(frozen=True)
class LocalFiles:
    """Slice ``index`` of ``split`` (by a hash of their names) of the files directly in the local folder ``root``."""

    root: str
    index: int
    split: int
    follow: bool
    claim: Claim | None = field(default=None, compare=False, repr=False)

    def entries(self, fs, extensions: tuple[str, ...], stat: bool) -> Iterator[Entry]:
        return local_files(self.root, self.index, self.split, extensions, stat, follow=self.follow, claim=self.claim)


@dataclass(frozen=True)
class S3Keys:
    """The keys of a prefix that one LIST page held whole (``contents``: its items)."""

    bucket: str
    contents: list

    def entries(self, fs, extensions: tuple[str, ...], stat: bool) -> Iterator[Entry]:
        return (_s3_entry(self.bucket, item) for item in self.contents if matches(item["Key"], extensions))


@dataclass(frozen=True)
class S3Range:
    """The keys under ``prefix`` from the item ``start`` up to the key ``stop`` (None: to the end)."""

    bucket: str
    prefix: str
    start: dict
    stop: str | None

    def entries(self, fs, extensions: tuple[str, ...], stat: bool) -> Iterator[Entry]:
        return _s3_range(fs, self.bucket, self.prefix, self.start, self.stop, extensions)


@dataclass(frozen=True)
class FsDir:
    """A folder of a store that is neither local nor S3, walked by ``ls``."""

    path: str

    def entries(self, fs, extensions: tuple[str, ...], stat: bool) -> Iterator[Entry]:
        return _walk_fsspec(fs, self.path, extensions)


@dataclass(frozen=True)
class FsFiles:
    """Files of such a store already listed with their details (``infos``)."""

    infos: list

    def entries(self, fs, extensions: tuple[str, ...], stat: bool) -> Iterator[Entry]:
        return (fsspec_entry(fs, info) for info in self.infos)


Unit = LocalDir | LocalFiles | S3Keys | S3Range | FsDir | FsFiles | UriListFile | InventoryFile


def list_unit(fs: fsspec.AbstractFileSystem, unit: Unit, extensions: tuple[str, ...], *, stat: bool = True,
              claim: Claim | None = None) -> Iterator[Entry]:
    """The entries of one planned unit, in a stable order.

    ``stat=False``: local files come without size and mtime (``(uri, None, None, None)``), for a caller that
    needs them only for some (``listing_blocks`` stats the objects that are not done already). ``claim``: asked
    before a folder out of the source is walked through a followed link (``pipeline.io.source_local.Claim``).
    """
    if claim is not None and isinstance(unit, (LocalDir, LocalFiles)):
        unit = replace(unit, claim=claim)
    yield from unit.entries(fs, extensions, stat)


def _walk_fsspec(fs: fsspec.AbstractFileSystem, folder: str, extensions: tuple[str, ...]) -> Iterator[Entry]:
    """The files under ``folder`` of a store that is neither local nor S3, by ``ls``; a folder that cannot be listed
    is a list_error entry (``fs.walk`` leaves such a sub-folder out, silently, whatever its ``on_error``)."""
    stack = [folder]
    while stack:
        current = stack.pop()
        try:
            listing = sorted(fs.ls(current, detail=True), key=lambda e: e["name"])
        except FileNotFoundError:
            continue  # removed since its parent was listed
        except OSError as err:
            scheme, _, path = fs.unstrip_protocol(current).partition("://")
            yield list_error(object_uri(scheme, path.rstrip("/") + "/"), f"cannot list: {os_error_text(err)}")
            continue
        dirs = [e["name"] for e in listing if e.get("type") == "directory" and e["name"].rstrip("/") != current]
        yield from (fsspec_entry(fs, e) for e in listing if e.get("type", "file") == "file" and
                    matches(e["name"], extensions))
        stack.extend(reversed(dirs))


def entries_table(entries: list[Entry], errors: list[Entry] = ()) -> pa.Table:
    """Listing rows of ``entries`` and, after them, the error rows of ``errors`` (``list_error`` entries)."""
    rows = [e[:4] + (None, None) for e in entries] + [e[:4] + (STATUS_ERROR, e[4]) for e in errors]
    uris, sizes, etags, mtimes, status, error = zip(*rows) if rows else ((),) * 6
    return pa.Table.from_arrays(
        [pa.array(uris, pa.string()), pa.array(sizes, pa.int64()), pa.array(etags, pa.string()),
         pa.array(mtimes, pa.int64()).cast(pa.timestamp("us", tz="UTC")), pa.array([False] * len(uris)),
         pa.array(status, pa.string()), pa.array(error, pa.string())],
        schema=LISTING_SCHEMA)


def listing_blocks(fs: fsspec.AbstractFileSystem, group: list, extensions: tuple[str, ...], *, done: np.ndarray,
                   previous: np.ndarray, report: Callable[[int, int, float, np.ndarray | None], None] | None = None,
                   claim: Claim | None = None, named: bool = False) -> Iterator[pa.Table]:
    """List a group of units as blocks of listing rows (``LISTING_SCHEMA``), dropping done and carried objects.

    Objects already committed (``done``: sorted uri hashes) are skipped. Objects whose version matches a carryable
    row of the previous run (``previous``: sorted identity hashes) are left out of the blocks; their identities
    go to ``report(listed, skipped, seconds, carried_identities)`` (sent every CARRY_FLUSH objects and at the end),
    so the job copies those rows afterwards, shard by shard. ``named``: the units are a manifest's, whose entries
    are rows even when the object is gone (the fetch makes them ``not_found``), so local ones are not stat-ed.
    """
    carried: list[np.ndarray] = []
    pending: list[Entry] = []
    fresh: list[pa.Table] = []
    fresh_since = [time.monotonic()]
    clock = [time.perf_counter()]  # listing time excludes the waits while downstream consumes a block

    # Per object this is a few list operations and one or two hashes over Python values the listing made: no
    # Arrow table is built for what is done or carried, and a local file is stat-ed only when it is not done.
    def flush(final: bool = False) -> Iterator[pa.Table]:
        nonlocal pending, carried, fresh
        block, pending = pending, []
        skipped = 0
        if done.size and block:
            keep = ~done_mask(done, [e[0] for e in block])
            skipped = len(block) - int(keep.sum())
            if skipped:
                block = [e for e, k in zip(block, keep) if k]
        errors = [e for e in block if is_error(e)]
        block = [e for e in block if not is_error(e)] if errors else block
        block = block if named else stat_local(block)
        n_carried = 0
        if previous.size and block:
            uris, sizes, etags, mtimes = zip(*block)
            ids = identity_hashes(uris, etags, sizes, mtimes)
            # An entry with no version (a URI list without ETag or mtime) is never carried: it may have changed.
            same = member(previous, ids) & np.array([e is not None or m is not None for e, m in zip(etags, mtimes)])
            n_carried = int(same.sum())
            if n_carried:
                carried.append(ids[same])
                block = [e for e, s in zip(block, same) if not s]
        send = None
        if carried and (final or sum(c.size for c in carried) >= CARRY_FLUSH):
            send, carried = np.concatenate(carried), []
        if report is not None:
            report(len(block) + n_carried + len(errors), skipped, time.perf_counter() - clock[0], send)
        if block or errors:
            fresh.append(entries_table(block, errors))
        held = sum(b.num_rows for b in fresh)
        if held and (final or held >= FRESH_BLOCK_ROWS or time.monotonic() - fresh_since[0] >= FRESH_WAIT_S):
            out, fresh = pa.concat_tables(fresh), []
            fresh_since[0] = time.monotonic()
            # One fetch task per block downstream: blocks of at most FRESH_BLOCK_ROWS rows keep a task's fetched
            # bytes small, so many fetch tasks fit the fetch-ahead budget at once.
            for start in range(0, out.num_rows, FRESH_BLOCK_ROWS):
                yield out.slice(start, FRESH_BLOCK_ROWS)
        clock[0] = time.perf_counter()

    for unit in group:
        for entry in list_unit(fs, unit, extensions, stat=False, claim=claim):
            pending.append(entry)
            if len(pending) >= BLOCK_ROWS:
                yield from flush()
    yield from flush(final=True)


_KEYS_CACHE: dict[Any, np.ndarray] = {}


def resolve_keys(ref: Any) -> np.ndarray:
    """A sorted int64 key array given as an array or a Ray object ref (fetched once per worker, zero-copy)."""
    if ref is None:
        return np.empty(0, np.int64)
    if isinstance(ref, np.ndarray):
        return ref
    key = ref.hex()
    if key not in _KEYS_CACHE:
        import ray  # noqa: PLC0415 - only inside a listing task, which Ray runs

        if len(_KEYS_CACHE) > 4:
            _KEYS_CACHE.clear()
        _KEYS_CACHE[key] = ray.get(ref)
    return _KEYS_CACHE[key]
