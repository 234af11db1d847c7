"""Object URIs and their 64-bit keys: percent-encoded URIs, URI and version (identity) hashes, set membership."""

from __future__ import annotations

import hashlib
import os
import re
from urllib.parse import quote_from_bytes, unquote, unquote_to_bytes

import numpy as np

# Characters a uri's path keeps as they are; every other byte is percent-encoded, as pathlib's ``as_uri()`` does,
# so that urllib.parse, fsspec and pyarrow.fs read the URI back as the same object (``#``, ``?``, ``%``, spaces).
URI_SAFE = "/"
_PLAIN = re.compile(r"[A-Za-z0-9_.~/-]*")  # a path of these characters is its own encoding (the common case)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.~/-]+")
# A URI's scheme: what comes before its first "://", holding no "/" (so dir/a://b.jpg is a path); fsspec's chained
# schemes (simplecache::s3) are schemes too.
SCHEME = r"[^/]+"
LOCALHOST = "localhost"  # the host of a local file's URI that names one (RFC 8089), as file:/// does


def _quoted(match: re.Match) -> str:
    return "".join(f"%{b:02X}" for b in match.group().encode())


def object_uri(scheme: str, path: str | bytes) -> str:
    """The URI of an object: ``scheme://`` and its path (local, or bucket/key) percent-encoded.

    A local path with bytes that are not UTF-8 (a ``str`` from ``os.fsdecode``) keeps those bytes, encoded.
    """
    if isinstance(path, str) and _PLAIN.fullmatch(path):
        return f"{scheme}://{path}"
    if isinstance(path, str):
        try:  # quote_from_bytes' result, only the runs that need it encoded (a listing's hot path)
            return f"{scheme}://{_UNSAFE.sub(_quoted, path)}"
        except UnicodeEncodeError:
            pass  # a local name that is not UTF-8: its raw bytes, below
    raw = path if isinstance(path, bytes) else os.fsencode(path) if scheme == "file" else path.encode()
    return f"{scheme}://{quote_from_bytes(raw, URI_SAFE)}"


def uri_path(uri: str) -> str:
    """The path (local) or ``bucket/key`` that ``object_uri`` encoded; a local name's raw bytes come back as
    ``os.fsdecode`` gives them."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    return os.fsdecode(unquote_to_bytes(rest)) if scheme == "file" else unquote(rest, errors="strict")


def canonical_uri(text: str, base: tuple[str, str] | None = None) -> str:
    """The URI the output writes for the object ``text`` names: the one rule for a manifest's entries and prefixes.

    A URI (``scheme://…``, ``file://`` included; the scheme in any case) is percent-encoded: decoded once, then
    encoded as ``object_uri`` does; a local file's URI may also be ``file://localhost/…`` or ``file:/…`` (as Hadoop
    and Java write it). A path without a scheme is taken as written, never decoded: an absolute one is a local file,
    a relative one is under ``base`` (scheme, decoded folder path: the list's folder; no base: the working
    directory). Local paths are normalised (``..`` resolved) as a listing would name them.
    """
    text = text.strip()
    head, sep, rest = text.partition("://")
    if sep and head and "/" not in head:  # SCHEME, tested without a regex on the listing's hot path
        scheme = head.lower()
        if scheme != "file":
            return object_uri(scheme, unquote(rest, errors="strict") if "%" in rest else rest)
        return _file_uri(rest[len(LOCALHOST):] if rest.startswith(LOCALHOST + "/") else rest)
    if text[:6].lower() == "file:/":
        return _file_uri(text[5:])
    if text.startswith("/") or base is None:
        return object_uri("file", os.path.abspath(text))
    scheme, folder = base
    path = f"{folder.rstrip('/')}/{text}"
    return object_uri(scheme, os.path.normpath(path) if scheme == "file" else path)


def _file_uri(encoded: str) -> str:
    return object_uri("file", os.path.normpath(os.fsdecode(unquote_to_bytes(encoded)) if "%" in encoded else encoded))


def legacy_uri(uri: str) -> str | None:
    """The URI of the same object in the form outputs held before URIs were percent-encoded (``scheme://`` + the
    raw path), or None where both forms are the same or the old form could not exist (a name not UTF-8)."""
    if "%" not in uri:
        return None
    scheme, _, rest = uri.partition("://")
    try:
        return f"{scheme}://{unquote_to_bytes(rest).decode()}"
    except UnicodeDecodeError:
        return None


def uri_hash(uri: str) -> int:
    """A stable signed 64-bit key of a URI, for compact membership sets across processes."""
    return int.from_bytes(hashlib.blake2b(uri.encode(), digest_size=8).digest(), "little", signed=True)


def uri_hashes(uris: list[str]) -> np.ndarray:
    """``uri_hash`` of many URIs, as an int64 array (the digests joined, then read as little-endian int64)."""
    b2 = hashlib.blake2b
    return np.frombuffer(b"".join([b2(u.encode(), digest_size=8).digest() for u in uris]), "<i8").astype(np.int64)


def identity_hashes(uris: list[str], etags: list, sizes: list, mtimes_us: list) -> np.ndarray:
    """``identity_hash`` of many rows (mtimes already in microseconds), as an int64 array."""
    b2 = hashlib.blake2b
    digests = [b2((f"{u}\0e\0{e}\0{s}" if e else f"{u}\0m\0{s}\0{m}").encode(), digest_size=8).digest()
               for u, e, s, m in zip(uris, etags, sizes, mtimes_us)]
    return np.frombuffer(b"".join(digests), "<i8").astype(np.int64)


def member(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Boolean mask: which ``values`` are in the sorted array ``keys`` (vectorised binary search)."""
    if keys.size == 0 or values.size == 0:
        return np.zeros(values.shape, dtype=bool)
    idx = np.searchsorted(keys, values)
    idx[idx == keys.size] = 0
    return keys[idx] == values


def identity_hash(uri: str, etag: str | None, size: int | None, mtime_us: int | None) -> int:
    """Key of an object's version: the ETag when the storage has one, else size and mtime (in microseconds)."""
    if etag:
        key = f"{uri}\0e\0{etag}\0{size}"
    else:
        key = f"{uri}\0m\0{size}\0{mtime_us}"
    return uri_hash(key)


def done_mask(done: np.ndarray, uris: list[str]) -> np.ndarray:
    """Which ``uris`` have a committed row in ``done`` (sorted uri hashes), under their URI or under the raw form
    that outputs held before URIs were percent-encoded (so those outputs resume without doubling a row)."""
    hit = member(done, uri_hashes(uris))
    old = [(i, legacy) for i, u in enumerate(uris) if "%" in u and (legacy := legacy_uri(u)) is not None]
    if old:
        hit[[i for i, _ in old]] |= member(done, uri_hashes([legacy for _, legacy in old]))
    return hit
