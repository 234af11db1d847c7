"""The 64-bit keys of objects: URI and version (identity) hashes, and membership in sorted key arrays."""

from __future__ import annotations

import hashlib

import numpy as np


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
