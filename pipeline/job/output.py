"""DEST and --previous without Ray: preparing the output, and the resume, carry-over and count sets from records.

Everything here reads shard records (Parquet footers), one shard at a time; what it keeps grows by 8 bytes per
object at most (sorted int64 hash arrays), never by rows or strings.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np
import pyarrow as pa

from pipeline.errors import BulkClassifyError, OutputError
from pipeline.io.keys import member, uri_hashes
from pipeline.io.reader import (
    GROUP_RE, committed_parts, is_committed_shard, iter_records, read_json, read_record, read_shard,
)
from pipeline.io.source import LocalDir
from pipeline.io.writer import TEMP_RE, part_name, shard_id, write_json, write_shard
from pipeline.schema import BOOKKEEPING, BOOKKEEPING_KEYS, RUN_INFO, STATUS_ERROR, STATUS_OK, SUCCESS
from pipeline.storage import is_local, open_fs, storage_failure

if TYPE_CHECKING:
    from pipeline.model.folder import ModelBundle
    from pipeline.model.model_set import ModelSet

LOG = logging.getLogger(__name__)
ERRNO_RE = re.compile(r"\[Errno (\d+)\] ([^\n:']+)(?:: '([^'\n]*)')?")  # an OSError as str() writes it
# What to do about a write to DEST that storage refused, by errno.
FIXES = {
    errno.ENOSPC: "free space there or choose another --output, then rerun (it resumes)",
    errno.EDQUOT: "raise the quota or free space there, then rerun (it resumes)",
    errno.EROFS: "it is read-only; choose another --output",
    errno.EACCES: "check its permissions, or choose another --output",
    errno.EPERM: "check its permissions, or choose another --output",
}


@dataclass(frozen=True)
class Store:
    """One storage location, opened once: the URL as the run names it, its file system and root path."""

    url: str
    fs: Any
    root: str
    storage_options: Mapping[str, Any]

    @property
    def local(self) -> bool:
        return is_local(self.fs)


def open_store(url: str, storage_options: Mapping[str, Any]) -> Store:
    """``url`` opened (``pipeline.io.source.open_fs``)."""
    fs, root = open_fs(url, storage_options)
    return Store(url, fs, root, dict(storage_options))



@dataclass
class OutputIndex:
    """What DEST (or --previous) holds, from its shard records: counts and sorted int64 hash sets."""

    parts: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    uri_hashes: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # every committed row
    identities: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # carryable rows only
    # ok rows the carry set left out, by (model, digest, top-k) of their shards: another model, set or top-k
    passed_over: Counter = field(default_factory=Counter)

    @property
    def rows(self) -> int:
        return sum(self.counts.values())


def same_model(digest: str | None, name: str | None, bundle: ModelBundle | ModelSet) -> bool:
    """Were rows recorded with this model digest (and name) written by ``bundle``'s model?

    Outputs written before digests were recorded name their model alone: rows named as the built-in model count as
    the built-in model's (so they still resume and carry over with it); any other model's cannot be told apart and
    never match.
    """
    from pipeline.model.folder import BUILTIN_NAME, is_builtin
    from pipeline.model.model_set import ModelSet

    if digest:
        return digest == bundle.digest
    return name == BUILTIN_NAME and not isinstance(bundle, ModelSet) and is_builtin(bundle)


def index_output(fs: Any, root: str, *, hashes: bool = True, carry_model: ModelBundle | None = None,
                 carry_top_k: int | None = None, parts: list[str] | None = None) -> OutputIndex:
    """Read every shard's record under ``root`` (or of ``parts``: an Iceberg snapshot's shards).

    Args:
        hashes: collect the committed rows' uri hashes (the resume set).
        carry_model, carry_top_k: collect the identities of ok rows of this model (a ``ModelBundle``, matched by
            digest) and top-k (the carry set).
    """
    index = OutputIndex(parts=committed_parts(fs, root) if parts is None else parts)
    uris: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    for _path, rec in iter_records(fs, index.parts):
        index.counts[STATUS_OK] += rec.ok
        index.counts[STATUS_ERROR] += rec.errors
        if hashes:
            uris.append(rec.uri_hashes)
        if carry_model is not None:
            if rec.top_k == carry_top_k and same_model(rec.model_digest, rec.model, carry_model):
                ids.append(rec.identities)
            elif rec.ok:
                index.passed_over[(rec.model, rec.model_digest, rec.top_k)] += rec.ok
        if len(uris) > 256:  # compact as we go: the peak stays near 8 bytes per row
            uris = [np.unique(np.concatenate(uris))]
        if len(ids) > 256:
            ids = [np.unique(np.concatenate(ids))]
    if uris:
        index.uri_hashes = np.unique(np.concatenate(uris))
    if ids:
        index.identities = np.unique(np.concatenate(ids))
    return index


class RecordCounter:
    """Rows by status summed from shard footers handed to it one at a time (``on_footer`` of a footer pass)."""

    def __init__(self, fs: Any):
        self.fs, self.ok, self.errors = fs, 0, 0

    def __call__(self, path: str, footer: Any) -> None:
        rec = read_record(self.fs, path, footer)
        self.ok += rec.ok
        self.errors += rec.errors

    @property
    def counts(self) -> dict[str, int]:
        return {STATUS_OK: self.ok, STATUS_ERROR: self.errors}


def read_previous(previous: Store, bundle: ModelBundle | ModelSet, top_k: int, parts: list[str] | None = None
                  ) -> OutputIndex:
    """The ``previous`` store (``parts``: an Iceberg table's current shards): its shards and the identities of the
    rows this run may carry (same model digest and ``top_k``, ok).

    Error rows are never carried: they are retried (storage or a bad upload may have been fixed since).
    """
    index = index_output(previous.fs, previous.root, hashes=False, carry_model=bundle, carry_top_k=top_k,
                         parts=parts)
    if not index.parts:
        raise OutputError(f"--previous {previous.url!r} holds no committed output; drop the option or fix the URL")
    LOG.info("previous run %s: %d rows can be carried over", previous.url, index.identities.size)
    if index.passed_over:
        LOG.warning("%s", passed_over_note(previous.url, index.passed_over, bundle, top_k))
    return index


def passed_over_note(url: str, passed_over: Counter, bundle: ModelBundle | ModelSet, top_k: int) -> str:
    """Why ok rows of ``url`` are not carried over (another model, model set or top-k) and what that costs."""
    def model(name: str | None, digest: str | None) -> str:
        return f"{name or 'several models'!r} digest {digest[:12] if digest else 'unrecorded'}"

    rows = sum(passed_over.values())
    (name, digest, k), _ = passed_over.most_common(1)[0]
    was = f"model {model(name, digest)}, top-k {k if k is not None else 'mixed'}"
    if len(passed_over) > 1:
        was += f" (and {len(passed_over) - 1} other model/top-k combination(s))"
    return (f"--previous {url!r}: {rows} ok row(s) are not carried over: they were written by {was}, this run by "
            f"model {model(bundle.name, bundle.digest)}, top-k {top_k}; every model of this run classifies them "
            "again. To add a model to an output, classify with the new model alone and join on uri "
            "(docs/output.md)")


def resolve_location(url: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """Where ``url`` points, whatever its spelling: ``file://`` + the real path locally (links, ``.``, ``..``
    resolved), else the store's protocol and the path without empty segments at its ends."""
    return store_location(*open_fs(url, storage_options))


def store_location(fs: Any, path: str) -> str:
    """``resolve_location`` of an opened store."""
    if is_local(fs):
        return "file://" + os.path.realpath(path)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return f"{protocols[0]}://{path.strip('/')}"


def check_output_location(source: Store, output: Store) -> None:
    """Refuse an output that is the source or holds it; an output inside the source is allowed (never listed)."""
    out, src = store_location(output.fs, output.root), store_location(source.fs, source.root)
    if src == out or src.startswith(out.rstrip("/") + "/"):
        what = "is SOURCE" if src == out else "holds SOURCE"
        raise OutputError(f"--output {output.url!r} {what} {source.url!r} (they resolve to {out} and {src}); "
                          "choose an --output outside the source folder")


def excluded_prefix(source: Store, output: Store) -> str | None:
    """The listing path (under the source's root) of an output inside a local source, so the listing skips it."""
    out, src = store_location(output.fs, output.root), store_location(source.fs, source.root)
    if not is_local(source.fs) or not out.startswith(src.rstrip("/") + "/"):
        return None
    return source.root.rstrip("/") + "/" + os.path.relpath(out[7:], src[7:])


def without_folder(groups: list[list], folder: str | None) -> list[list]:
    """The listing plan without the local folder units at or under ``folder`` (an output inside the source)."""
    if folder is None:
        return groups
    inside = folder.rstrip("/") + "/"
    kept = [[u for u in g if not (isinstance(u, LocalDir) and (u.path.rstrip("/") + "/").startswith(inside))]
            for g in groups]
    return [g for g in kept if g] or [[]]


def check_output(fs: Any, root: str, url: str) -> None:
    """Read-only checks of DEST before anything is changed: not a file, and on object stores a bucket that exists
    (a missing bucket is never created)."""
    try:
        if fs.exists(root) and fs.info(root).get("type") == "file":
            raise OutputError(f"--output {url!r} is a file; give a folder or prefix")
        blocker = file_above(fs, root)
        if blocker is not None:
            raise OutputError(f"--output {url!r} is under {blocker!r}, which is a file, so no folder can be made "
                              "there; choose another --output (or move that file)")
        if not is_local(fs):
            bucket = root.strip("/").split("/", 1)[0]
            if not fs.exists(bucket):
                raise OutputError(f"--output {url!r}: bucket {bucket!r} does not exist; create it first "
                                  "or fix the URL (this tool never creates buckets)")
    except OutputError:
        raise
    except Exception as err:  # noqa: BLE001
        raise OutputError(storage_failure(url, err)) from None


def file_above(fs: Any, path: str) -> str | None:
    """The file a local ``path`` would be a folder under (``afile`` of ``afile/sub``), or None: on object stores a
    key and a prefix of the same name live side by side."""
    if not is_local(fs):
        return None
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    return parent if os.path.exists(parent) and not os.path.isdir(parent) else None


def begin_output(fs: Any, root: str, run_info: Mapping[str, Any], *, overwrite: bool = False) -> None:
    """The first changes to DEST, under the run's lease: --overwrite removes this tool's files, temporary files of
    an interrupted run are reclaimed, ``_RUN.json`` is written, and then a stale ``_SUCCESS`` goes."""
    if overwrite:
        remove_owned(fs, root)
    reclaim_temporary(fs, root)
    write_json(fs, root, RUN_INFO, run_info)
    # A run in progress is not a completed run: _SUCCESS comes back when this one completes.
    success = f"{root.rstrip('/')}/{SUCCESS}"
    if fs.exists(success):
        fs.rm_file(success)


def _folders(fs: Any, root: str) -> Iterator[tuple[str, list[dict]]]:
    """DEST and its shard group folders, with their entries."""
    top = fs.ls(root, detail=True) if fs.exists(root) else []
    yield root, top
    for info in top:
        if info.get("type") == "directory" and GROUP_RE.match(info["name"].rstrip("/").rsplit("/", 1)[-1]):
            yield info["name"], fs.ls(info["name"], detail=True)


def reclaim_temporary(fs: Any, root: str) -> None:
    """Remove temporary files an interrupted or failed run left (only this tool's names; the lease is held)."""
    for _folder, entries in _folders(fs, root):
        for info in entries:
            if info.get("type") != "directory" and TEMP_RE.match(info["name"].rsplit("/", 1)[-1]):
                fs.rm_file(info["name"])


def remove_owned(fs: Any, root: str) -> None:
    """--overwrite: delete the shards this tool committed (their footer holds our commit record under their own
    name), its bookkeeping files and temporary files in DEST and its group folders; never another file."""
    for folder, entries in _folders(fs, root):
        for info in entries:
            path, base = info["name"].rstrip("/"), info["name"].rstrip("/").rsplit("/", 1)[-1]
            if info.get("type") == "directory":
                continue
            if (TEMP_RE.match(base) or is_committed_shard(fs, path)
                    or (folder == root and base in BOOKKEEPING and _is_bookkeeping(fs, path))):
                fs.rm_file(path)
        if folder != root:
            try:
                if not fs.ls(folder, detail=False):
                    fs.rmdir(folder)
            except (OSError, FileNotFoundError):
                pass  # object stores have no folders to remove


def _is_bookkeeping(fs: Any, path: str) -> bool:
    try:
        payload = json.loads(fs.cat_file(path))
    except (ValueError, OSError):
        return False
    return isinstance(payload, dict) and all(k in payload for k in BOOKKEEPING_KEYS)


def dedupe_output(fs: Any, root: str, url: str) -> int:
    """Drop rows whose URI an earlier shard (by path) holds too, rewriting the later shards without them; the rows
    dropped. Two runs that wrote DEST at once (the lease missed) end with one row per input all the same."""
    parts = committed_parts(fs, root)
    keys, owners = [], []
    for i, (_path, rec) in enumerate(iter_records(fs, parts)):
        keys.append(rec.uri_hashes)
        owners.append(np.full(rec.uri_hashes.size, i, np.int32))
    if not keys:
        return 0
    key, owner = np.concatenate(keys), np.concatenate(owners)
    order = np.lexsort((owner, key))
    key, owner = key[order], owner[order]
    again = np.zeros(key.size, bool)
    again[1:] = key[1:] == key[:-1]
    if not again.any():
        return 0
    # The shard that holds a URI first keeps one row of it, also when it holds the URI twice (a manifest that names
    # an object twice): only its later rows of that URI go.
    first_owner = owner[np.maximum.accumulate(np.where(~again, np.arange(key.size), 0))]
    dropped, written = 0, set()
    for i in np.unique(owner[again]):
        if parts[i] in written:  # holds the rows just committed under this name: those stay
            continue
        mine = again & (owner == i)
        n, new_path = drop_rows(fs, root, parts[i], np.unique(key[mine & (first_owner != i)]),
                                keep_first=np.unique(key[mine & (first_owner == i)]))
        dropped += n
        written.add(new_path)
        fs.rm_file(parts[i])
    LOG.warning("%s held %d rows of URIs another row holds too (two runs wrote it at once, or a manifest named an "
                "object twice); removed them", url, dropped)
    return dropped


def drop_rows(fs: Any, root: str, path: str, uri_keys: np.ndarray,
              keep_first: np.ndarray | None = None) -> tuple[int, str | None]:
    """Commit the rows of the shard at ``path`` whose uri hash is not in sorted ``uri_keys`` as a new shard, of those
    in sorted ``keep_first`` only the first row; the rows left out and the new shard's path (None: none left)."""
    from pipeline.quality.statistics import quality_footer

    table, record = read_shard(fs, path)
    hashes = record.uri_hashes if record is not None and record.uri_hashes.size == table.num_rows else None
    hashes = hashes if hashes is not None else uri_hashes(table.column("uri").to_pylist())
    keep = ~member(uri_keys, hashes)
    if keep_first is not None and keep_first.size:
        twice = np.nonzero(member(keep_first, hashes))[0]
        keep[twice] = False
        keep[twice[np.unique(hashes[twice], return_index=True)[1]]] = True
    if not keep.any():
        return table.num_rows, None
    rows = table.filter(pa.array(keep))
    write_shard(rows, store=(fs, root), footer=quality_footer)
    return int((~keep).sum()), f"{root.rstrip('/')}/{part_name(shard_id(rows.column('uri').to_pylist()))}"


def check_compatible(fs: Any, root: str, url: str, bundle: ModelBundle | ModelSet, *, top_k: int, overwrite: bool) -> None:
    """Refuse to mix rows of another model (by digest: a retrained model in the same folder is another model) or
    top-k into DEST (unless --overwrite)."""
    info = read_json(fs, root, RUN_INFO)
    if not info or overwrite:
        return
    fix = "pass --overwrite to start over or choose another --output"
    digest = info.get("model_digest")
    if not same_model(digest, info.get("model"), bundle):
        if not digest:
            raise OutputError(f"--output {url!r} holds rows of model {info.get('model')!r} written before "
                              f"model digests were recorded, so they cannot be told from {bundle.name!r} "
                              f"(digest {bundle.short_digest}); {fix}")
        raise OutputError(f"--output {url!r} holds rows of model {info.get('model')!r} digest {digest[:12]}, "
                          f"not {bundle.name!r} digest {bundle.short_digest} (its files, labels or preprocess.json "
                          f"differ); {fix}")
    if info.get("top_k") != top_k:
        raise OutputError(f"--output {url!r} holds rows of top-k {info.get('top_k')}, not {top_k}; "
                          f"{fix}")


@contextlib.contextmanager
def storage_errors(url: str, root: str) -> Iterator[None]:
    """Turn a failed write to DEST (a full disk, a refused write), also one raised in a Ray task, into one
    ``OutputError`` line naming DEST and the cause."""
    try:
        yield
    except BulkClassifyError:
        raise
    except Exception as err:  # noqa: BLE001 - only storage causes are translated, the rest is re-raised
        cause = _storage_cause(err, root)
        if cause is None:
            raise
        detail = f"[Errno {cause.errno}] {cause.strerror}" if cause.errno and cause.strerror else str(cause)
        where = f" ({cause.filename})" if getattr(cause, "filename", None) else ""
        fix = FIXES.get(cause.errno or 0, "check that storage and its permissions, then rerun (it resumes)")
        raise OutputError(f"cannot write --output {url!r}: {detail}{where}; {fix}".replace("\n", " ")) from None


def _storage_cause(err: BaseException, root: str) -> OSError | None:
    """The OSError at the root of ``err`` (through Ray's wrappers) if it concerns DEST, else None."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found = e if isinstance(e, OSError) and type(e).__module__ == "builtins" else _reported_oserror(e)
        if found is not None:
            name = str(found.filename or "")
            if (name and root.rstrip("/") in name) or (not name and found.errno in FIXES):
                return found
        stack += [e.__cause__, e.__context__, getattr(e, "cause", None)]
    return None


def _reported_oserror(err: BaseException) -> OSError | None:
    """The OSError a Ray task raised, rebuilt from the worker's traceback in ``err``'s text (Ray passes the
    exception's message and traceback to the driver, not the OSError itself)."""
    if not type(err).__module__.startswith("ray"):
        return None
    found = ERRNO_RE.findall(str(err))
    if not found:
        return None
    code, text, name = found[-1]
    return OSError(int(code), text.strip(), name or None)
