"""DEST and --previous without Ray: preparing the output, and the resume, carry-over and count sets from records.

Everything here reads shard records (Parquet footers), one shard at a time; what it keeps grows by 8 bytes per
object at most (sorted int64 hash arrays), never by rows or strings.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config import RunConfig
from pipeline.errors import OutputError
from pipeline.schema import OWNED_PREFIXES, RUN_INFO, SUCCESS
from pipeline.source import open_fs, storage_failure
from pipeline.writer import GROUP_RE, committed_parts, iter_records, read_json, read_record

LOG = logging.getLogger(__name__)


@dataclass
class OutputIndex:
    """What DEST (or --previous) holds, from its shard records: counts and sorted int64 hash sets."""

    parts: list[str] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    uri_hashes: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # every committed row
    identities: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # carryable rows only

    @property
    def rows(self) -> int:
        return sum(self.counts.values())


def index_output(fs: Any, root: str, *, hashes: bool = True, carry_model: str | None = None,
                 carry_top_k: int | None = None) -> OutputIndex:
    """Read every shard's record under ``root``.

    Args:
        hashes: collect the committed rows' uri hashes (the resume set).
        carry_model, carry_top_k: collect the identities of ok rows of this model and top-k (the carry set).
    """
    index = OutputIndex(parts=committed_parts(fs, root))
    uris: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    for _path, rec in iter_records(fs, index.parts):
        index.counts["ok"] += rec.ok
        index.counts["error"] += rec.errors
        if hashes:
            uris.append(rec.uri_hashes)
        if carry_model is not None and rec.model == carry_model and rec.top_k == carry_top_k:
            ids.append(rec.identities)
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
        return {"ok": self.ok, "error": self.errors}


def count_output(fs: Any, root: str) -> dict[str, int]:
    """Rows in DEST by status, from the shard records."""
    counts = index_output(fs, root, hashes=False).counts
    return {"ok": counts.get("ok", 0), "error": counts.get("error", 0)}


def read_previous(config: RunConfig, model_name: str) -> OutputIndex:
    """--previous: its shards and the identities of the rows this run may carry (same model and top-k, ok).

    Error rows are never carried: they are retried (storage or a bad upload may have been fixed since).
    """
    fs, root = open_fs(config.previous, config.storage_options)
    index = index_output(fs, root, hashes=False, carry_model=model_name, carry_top_k=config.top_k)
    if not index.parts:
        raise OutputError(f"--previous {config.previous!r} holds no committed output; drop the option or fix the URL")
    LOG.info("previous run %s: %d rows can be carried over", config.previous, index.identities.size)
    return index


def prepare_output(fs: Any, root: str, config: RunConfig) -> None:
    """Check DEST is a writable folder; --overwrite removes this tool's files; a stale _SUCCESS goes."""
    try:
        if fs.exists(root) and fs.info(root).get("type") == "file":
            raise OutputError(f"--output {config.output!r} is a file; give a folder or prefix")
        fs.makedirs(root, exist_ok=True)
        if config.overwrite:
            remove_owned(fs, root)
        probe = f"{root.rstrip('/')}/_probe.{os.getpid()}"
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
        # A run in progress is not a completed run: _SUCCESS comes back when this one completes.
        success = f"{root.rstrip('/')}/{SUCCESS}"
        if fs.exists(success):
            fs.rm_file(success)
    except OutputError:
        raise
    except Exception as err:  # noqa: BLE001
        raise OutputError(storage_failure(config.output, err).replace("cannot read", "cannot write")) from None


def remove_owned(fs: Any, root: str) -> None:
    """--overwrite: delete this tool's files in DEST and its shard group folders, never anything else."""
    for info in fs.ls(root, detail=True):
        path = info["name"].rstrip("/")
        base = path.rsplit("/", 1)[-1]
        if info.get("type") == "directory" and GROUP_RE.match(base):
            for inner in fs.ls(path, detail=False):
                if inner.rsplit("/", 1)[-1].startswith(OWNED_PREFIXES):
                    fs.rm_file(inner)
            try:
                if not fs.ls(path, detail=False):
                    fs.rmdir(path)
            except (OSError, FileNotFoundError):
                pass  # object stores have no folders to remove
        elif base.startswith(OWNED_PREFIXES):
            fs.rm_file(path)


def check_compatible(fs: Any, root: str, config: RunConfig, model_name: str) -> None:
    """Refuse to mix rows of another model or top-k into DEST (unless --overwrite)."""
    info = read_json(fs, root, RUN_INFO)
    if not info or config.overwrite:
        return
    if info.get("model") != model_name or info.get("top_k") != config.top_k:
        raise OutputError(
            f"--output {config.output!r} holds rows of model {info.get('model')!r} top-k {info.get('top_k')}, "
            f"not {model_name!r} top-k {config.top_k}; pass --overwrite to start over or choose another --output"
        )
