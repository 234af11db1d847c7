"""Listing a local folder: the files of one planned unit, by os.scandir, with or without a stat each.

Symbolic links: one whose target is inside the source is not followed (its target is listed under its own path, so
nothing is listed twice and a link back up the tree is never walked); one that leads out of the source is followed
only with ``follow`` (``--follow-symlinks``), else it gets a ``list_error`` row. A folder that cannot be listed and
a link that cannot be resolved (a loop) get a ``list_error`` row too: the listing is never silently partial.
"""

from __future__ import annotations

import errno
import os
import zlib
from typing import Callable, Iterator, NamedTuple

from pipeline.errors import LIST_ERROR, ImageError
from pipeline.io.keys import object_uri, uri_path

# One listed object, kept a plain tuple because a listing holds millions: (uri, size_bytes, etag, mtime_us); an
# entry the listing could not read is (uri, None, None, None, error), told apart by its length (``is_error``).
Entry = tuple[str, int | None, str | None, int | None] | tuple[str, None, None, None, str]
FOLLOW_HINT = "pass --follow-symlinks to list it"


def local_entry(path: str, st: os.stat_result) -> Entry:
    return (object_uri("file", path), int(st.st_size), None, int(st.st_mtime * 1_000_000))


def list_error(uri: str, detail: str) -> Entry:
    """The entry of something the listing could not read: it becomes an error row of kind ``list_error``."""
    return (uri, None, None, None, str(ImageError(LIST_ERROR, detail)))


def is_error(entry: Entry) -> bool:
    return len(entry) > 4


def folder_uri(path: str) -> str:
    """A folder's URI ends with ``/``, so it never names a file of the same name."""
    return object_uri("file", path.rstrip("/") + "/")


def _suffixes(extensions: tuple[str, ...]) -> tuple[str, ...]:
    return tuple("." + e.lower() for e in extensions)


def os_error_text(err: OSError) -> str:
    return f"{type(err).__name__}: [Errno {err.errno}] {err.strerror}" if err.errno else f"{type(err).__name__}: {err}"


class _Folder(NamedTuple):
    """A folder to walk: its path as listed, and its real path where it was reached through a followed link."""

    path: str
    real: str | None


class _File(NamedTuple):
    """A file to list."""

    path: str


class _Unreadable(NamedTuple):
    """Something the listing cannot read: it gets a ``list_error`` row."""

    uri: str
    detail: str


Sorted = _Folder | _File | _Unreadable | None  # None: skipped
# Asked before a folder out of the source is walked through a followed link: True for the first listing task that
# asks about that folder (device, inode), so two links to it from different tasks list it once.
Claim = Callable[[tuple[int, int]], bool]


class _Links:
    """Sorts a folder's entries into folders to walk, files to list, unreadable entries and entries to skip."""

    def __init__(self, root: str, follow: bool, suffixes: tuple[str, ...], claim: Claim | None = None):
        self.root = os.path.realpath(root)
        self.follow, self.suffixes, self.claim = follow, suffixes, claim
        self.seen: set[tuple[int, int]] = set()  # folders walked through followed links: a loop out there ends

    def inside(self, real: str) -> bool:
        return real == self.root or real.startswith(self.root.rstrip(os.sep) + os.sep)

    def listed_name(self, name: str) -> bool:
        return name.lower().endswith(self.suffixes) and name[0] != "."

    def sort(self, entry: os.DirEntry, real_parent: str | None) -> Sorted:
        """What ``entry`` (in a folder whose real path is ``real_parent``, None if not reached by a link) is."""
        name = entry.name
        if not entry.is_symlink():
            if entry.is_dir(follow_symlinks=False):
                if real_parent is None:
                    return _Folder(entry.path, None)
                real = os.path.join(real_parent, name)
                # a folder of the source reached from outside it is listed under its own path, not again
                return None if self.inside(real) else self._walk_once(entry.path, real)
            return _File(entry.path) if self.listed_name(name) and entry.is_file(follow_symlinks=False) else None
        try:
            target = os.path.realpath(entry.path, strict=True)
            is_dir = os.path.isdir(target)
        except OSError as err:
            if err.errno == errno.ELOOP:
                return _Unreadable(object_uri("file", entry.path), f"symbolic link loop ({os_error_text(err)})")
            if self.listed_name(name):
                return _Unreadable(object_uri("file", entry.path), f"broken symbolic link ({os_error_text(err)})")
            return None
        if self.inside(target):
            # Its target is listed under its own path; a file link is listed only when its target's name is not.
            listed_anyway = is_dir or self.listed_name(os.path.basename(target))
            return None if listed_anyway or not self.listed_name(name) else _File(entry.path)
        if not self.follow:
            if is_dir:
                return _Unreadable(folder_uri(entry.path), f"symbolic link to a folder out of the source; {FOLLOW_HINT}")
            if self.listed_name(name):
                return _Unreadable(object_uri("file", entry.path),
                                   f"symbolic link to a file out of the source; {FOLLOW_HINT}")
            return None
        if is_dir:
            return self._walk_once(entry.path, target)
        return _File(entry.path) if self.listed_name(name) else None

    def _walk_once(self, path: str, real: str) -> Sorted:
        try:
            st = os.stat(real)
        except OSError as err:
            return _Unreadable(folder_uri(path), f"cannot list this folder: {os_error_text(err)}")
        key = (st.st_dev, st.st_ino)
        if key in self.seen:
            return None
        self.seen.add(key)
        if self.claim is not None and not self.claim(key):  # another listing task walks it
            return None
        return _Folder(path, real)


def _file_entry(path: str, stat: bool) -> Entry | None:
    if not stat:
        return (object_uri("file", path), None, None, None)
    try:
        return local_entry(path, os.stat(path))
    except FileNotFoundError:
        return None
    except OSError:  # unreadable metadata: the fetch gives the row its precise error
        return (object_uri("file", path), None, None, None)


def _sorted_entry(sorted_as: _File | _Unreadable, stat: bool) -> Entry | None:
    """The row of what ``_Links.sort`` called a file or unreadable; None for a file removed since it was listed."""
    if isinstance(sorted_as, _Unreadable):
        return list_error(sorted_as.uri, sorted_as.detail)
    return _file_entry(sorted_as.path, stat)


def walk_local(folder: str, extensions: tuple[str, ...], stat: bool = True, *, root: str | None = None,
               follow: bool = False, real: str | None = None, links: _Links | None = None,
               claim: Claim | None = None) -> Iterator[Entry]:
    """Every listed file under ``folder`` (``root``: the source, for telling links in from links out; ``real``:
    the folder's real path when it was reached through a followed link)."""
    links = links or _Links(root or folder, follow, _suffixes(extensions), claim)
    suffixes = links.suffixes
    stack: list[tuple[str, str | None]] = [(folder, real)]
    while stack:
        current, current_real = stack.pop()
        try:
            with os.scandir(current) as it:
                entries = sorted(it, key=lambda e: e.name)
        except FileNotFoundError:
            continue  # removed since its parent was listed
        except OSError as err:
            yield list_error(folder_uri(current), f"cannot list this folder: {os_error_text(err)}; its files get rows "
                                                  "on the run after its permissions are fixed")
            continue
        subdirs = []
        for entry in entries:
            if current_real is None and not entry.is_symlink():  # the common case, kept short: one call a file
                name = entry.name
                if entry.is_dir(follow_symlinks=False):
                    subdirs.append((entry.path, None))
                elif name.lower().endswith(suffixes) and name[0] != "." and entry.is_file(follow_symlinks=False):
                    found = _file_entry(entry.path, stat)
                    if found is not None:
                        yield found
                continue
            sorted_as = links.sort(entry, current_real)
            if sorted_as is None:
                continue
            if isinstance(sorted_as, _Folder):
                subdirs.append((sorted_as.path, sorted_as.real))
                continue
            found = _sorted_entry(sorted_as, stat)
            if found is not None:
                yield found
        stack.extend(reversed(subdirs))


def local_files(folder: str, part: int, parts: int, extensions: tuple[str, ...], stat: bool = True, *,
                follow: bool = False, claim: Claim | None = None) -> Iterator[Entry]:
    """The entries directly in the source ``folder`` that are not folders of its own (files and links), split
    into ``parts`` by a hash of their names."""
    links = _Links(folder, follow, _suffixes(extensions), claim)
    with os.scandir(folder) as it:
        for entry in it:
            if parts > 1 and zlib.crc32(os.fsencode(entry.name)) % parts != part:
                continue
            if entry.is_dir(follow_symlinks=False):
                continue  # the planner gave it a unit of its own
            if not entry.is_symlink():  # the common case, kept short: a plain file
                found = _file_entry(entry.path, stat) if links.listed_name(entry.name) and entry.is_file(
                    follow_symlinks=False) else None
                if found is not None:
                    yield found
                continue
            sorted_as = links.sort(entry, None)
            if sorted_as is None:
                continue
            if isinstance(sorted_as, _Folder):
                yield from walk_local(sorted_as.path, extensions, stat, real=sorted_as.real, links=links)
                continue
            found = _sorted_entry(sorted_as, stat)
            if found is not None:
                yield found


def stat_local(entries: list[Entry]) -> list[Entry]:
    """Size and mtime of local entries listed without them; a file removed since listing is dropped."""
    out = []
    for entry in entries:
        if entry[1] is not None or is_error(entry):
            out.append(entry)
            continue
        try:
            out.append(local_entry(uri_path(entry[0]), os.stat(uri_path(entry[0]))))
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:  # unreadable metadata: the fetch gives the row its precise error
            out.append(entry)
    return out
