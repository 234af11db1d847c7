"""Listing a local folder: the files of one planned unit, by os.scandir, with or without a stat each."""

from __future__ import annotations

import os
import zlib
from typing import Iterator

Entry = tuple  # (uri, size_bytes, etag, mtime_us)


def local_entry(path: str, st: os.stat_result) -> Entry:
    return ("file://" + path, int(st.st_size), None, int(st.st_mtime * 1_000_000))


def _suffixes(extensions: tuple[str, ...]) -> tuple[str, ...]:
    return tuple("." + e.lower() for e in extensions)


def walk_local(folder: str, extensions: tuple[str, ...], stat: bool = True) -> Iterator[Entry]:
    suffixes = _suffixes(extensions)
    stack = [folder]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as it:
                entries = sorted(it, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        subdirs = []
        for entry in entries:
            name = entry.name
            if entry.is_dir():
                subdirs.append(entry.path)
            elif name.lower().endswith(suffixes) and name[0] != "." and entry.is_file():
                yield local_entry(entry.path, entry.stat()) if stat else ("file://" + entry.path, None, None, None)
        stack.extend(reversed(subdirs))


def local_files(folder: str, part: int, parts: int, extensions: tuple[str, ...], stat: bool = True
                 ) -> Iterator[Entry]:
    suffixes = _suffixes(extensions)
    with os.scandir(folder) as it:
        for entry in it:
            name = entry.name
            if parts > 1 and zlib.crc32(name.encode()) % parts != part:
                continue
            if name.lower().endswith(suffixes) and name[0] != "." and entry.is_file():
                yield local_entry(entry.path, entry.stat()) if stat else ("file://" + entry.path, None, None, None)


def stat_local(entries: list[Entry]) -> list[Entry]:
    """Size and mtime of local entries listed without them; a file removed since listing is dropped."""
    out = []
    for entry in entries:
        if entry[1] is not None:
            out.append(entry)
            continue
        try:
            out.append(local_entry(entry[0][7:], os.stat(entry[0][7:])))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return out
