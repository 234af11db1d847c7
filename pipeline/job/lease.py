"""The lease on DEST: one run per output at a time, taken atomically, renewed while the run lives, released at its end.

The lease is ``DEST/_LEASE.json`` (holder's host, pid, start time, the time it was last renewed, its time to live and
a random token). It is created by an exclusive create on local disk (written whole, then ``link(2)``ed to its name) and by a conditional put
(``If-None-Match: *``) on S3, so of two runs starting at once exactly one gets it. A lease not renewed within its time
to live, or held by a process of this host that no longer exists, is taken over: on local disk under a lock on DEST's
folder, by replacing it in place if it is still the stale one, on S3 by a put conditional on the stale lease's ETag
(``If-Match``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from pipeline.errors import OutputError
from pipeline.schema import LEASE
from pipeline.storage import is_local

LOG = logging.getLogger(__name__)
LEASE_TTL_S = 120.0  # a lease not renewed for this long belongs to a run that is gone
RENEW_EVERY_S = LEASE_TTL_S / 6


class LeaseHeld(OutputError):
    """Another run holds the lease on DEST."""


class Lease:
    """The lease of one run on DEST; ``acquire`` it before the first change to DEST, ``release`` it at the end.

    Args:
        fs, root: DEST's filesystem and path; ``url`` is how the user spelled it (for messages).
        ttl_s: how long the lease outlives its last renewal.
    """

    def __init__(self, fs: Any, root: str, url: str, *, ttl_s: float = LEASE_TTL_S):
        self.fs, self.root, self.url, self.ttl_s = fs, root.rstrip("/"), url, ttl_s
        self.path = f"{self.root}/{LEASE}"
        self.token = uuid.uuid4().hex
        self.started_at = datetime.now(timezone.utc).isoformat()
        self.etag: str | None = None  # S3: the ETag of our lease object, for conditional renewal
        self.lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the holder's record ----

    def _body(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started_at": self.started_at,
                           "renewed_at": time.time(), "ttl_s": self.ttl_s, "token": self.token},
                          indent=2).encode()

    def holder(self) -> tuple[dict[str, Any] | None, str | None]:
        """The lease's record and (S3) ETag; (None, None) when there is none."""
        try:
            if is_local(self.fs):
                with open(self.path, "rb") as f:
                    return _parse(f.read()), None
            # The ETag is read first: a put conditional on it fails if the lease changed after this read.
            etag = _s3(self.fs, "head_object", self.path)["ETag"]
            return _parse(self.fs.cat_file(self.path)), etag
        except FileNotFoundError:
            return None, None

    def _gone(self, record: dict[str, Any]) -> bool:
        """The holder cannot be running: its lease expired, or it was a process of this host that has ended."""
        if time.time() - float(record.get("renewed_at") or 0) > float(record.get("ttl_s") or self.ttl_s):
            return True
        return record.get("host") == socket.gethostname() and not _alive(record.get("pid"), record.get("started_at"))

    # ---- acquire, renew, release ----

    def acquire(self) -> "Lease":
        """Take the lease (the first change to DEST), or raise ``LeaseHeld`` naming the holder."""
        for _attempt in range(3):
            if self._create():
                self._start_renewing()
                return self
            record, etag = self.holder()
            if record is None:
                continue  # released between our create and our read: try again
            if not self._gone(record):
                raise LeaseHeld(_held_message(self.url, self.path, record))
            LOG.warning("taking over the lease of %s: its holder (pid %s on %s) is gone", self.url,
                        record.get("pid"), record.get("host"))
            if self._take_over(record, etag):
                self._start_renewing()
                return self
        raise LeaseHeld(f"--output {self.url!r} changed hands while this run tried to take its lease; "
                        f"retry, or look at {self.path}")

    def _create(self) -> bool:
        body = self._body()
        if is_local(self.fs):
            # Written whole under a temporary name, then linked to the lease's name: link(2) fails if that name
            # exists, so the lease appears at once with its content, and only one of two runs creates it.
            made = not os.path.isdir(self.root)
            os.makedirs(self.root, exist_ok=True)
            tmp = f"{self.root}/.{LEASE}.{self.token}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(body)
                    f.flush()
                    os.fsync(f.fileno())
                os.link(tmp, self.path)
                return True
            except FileExistsError:
                return False
            except BaseException:
                _unlink(tmp)
                if made:  # a lease we could not write is no lease: leave DEST as it was
                    os.rmdir(self.root)
                raise
            finally:
                _unlink(tmp)
        try:
            self.etag = _s3(self.fs, "put_object", self.path, Body=body, IfNoneMatch="*")["ETag"]
            return True
        except _Precondition:
            return False

    def _take_over(self, stale: dict[str, Any], etag: str | None) -> bool:
        if not is_local(self.fs):
            try:
                self.etag = _s3(self.fs, "put_object", self.path, Body=self._body(), IfMatch=etag)["ETag"]
                return True
            except (_Precondition, FileNotFoundError):
                return False  # another run took it first (or it was released): acquire looks again
        # One takeover at a time (a lock on DEST's folder, dropped by the kernel if its process dies), and the
        # stale lease replaced in place, never removed: a lease path that is briefly absent lets a plain create win
        # beside the takeover.
        folder = os.open(self.root, os.O_RDONLY)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)
            record, _ = self.holder()
            if record is None:
                return self._create()  # released in between
            if record.get("token") != stale.get("token"):
                return False  # another run took it over in between: acquire looks again
            tmp = f"{self.root}/.{LEASE}.{self.token}.tmp"
            with open(tmp, "wb") as f:
                f.write(self._body())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            return True
        finally:
            os.close(folder)  # closing the descriptor drops the lock

    def _start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="bulk-classify-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(min(RENEW_EVERY_S, self.ttl_s / 3)):
            try:
                self.renew()
            except Exception as err:  # noqa: BLE001 - a failed renewal is retried; check() reports a lost lease
                LOG.warning("could not renew the lease on %s: %s", self.url, err)

    def renew(self) -> None:
        """Write a fresh ``renewed_at`` if the lease is still ours; mark it lost otherwise."""
        if is_local(self.fs):
            record, _ = self.holder()
            if record is None or record.get("token") != self.token:
                self.lost = True
                return
            tmp = f"{self.root}/.{LEASE}.{self.token}.tmp"
            with open(tmp, "wb") as f:
                f.write(self._body())
            os.replace(tmp, self.path)
            return
        try:
            self.etag = _s3(self.fs, "put_object", self.path, Body=self._body(), IfMatch=self.etag)["ETag"]
        except (_Precondition, FileNotFoundError):
            self.lost = True

    def check(self) -> None:
        """Raise if another run took the lease while this one ran (its counts would not be this run's alone)."""
        if self.lost:
            raise OutputError(f"this run lost its lease on --output {self.url!r} (not renewed within "
                              f"{self.ttl_s:.0f} s); rerun it to finish, it resumes")

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            record, etag = self.holder()
            if record is not None and record.get("token") == self.token:
                self.fs.rm_file(self.path) if not is_local(self.fs) else os.unlink(self.path)
        except Exception as err:  # noqa: BLE001 - the next run takes a stale lease over
            LOG.warning("could not remove the lease %s: %s", self.path, err)

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _held_message(url: str, path: str, record: dict[str, Any]) -> str:
    age = time.time() - float(record.get("renewed_at") or 0)
    return (f"--output {url!r} is in use by another run: pid {record.get('pid')} on {record.get('host')}, started "
            f"{record.get('started_at')}, lease renewed {age:.0f} s ago; wait for it to end, or if it is gone "
            f"delete {path} (a later run takes it over {float(record.get('ttl_s') or LEASE_TTL_S):.0f} s after "
            "its last renewal)")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _parse(data: bytes) -> dict[str, Any]:
    try:
        record = json.loads(data)
    except ValueError:
        record = None
    return record if isinstance(record, dict) else {}  # an unreadable lease has no renewed_at: it counts as expired


def _alive(pid: Any, started_at: Any) -> bool:
    import psutil

    try:
        proc = psutil.Process(int(pid))
    except (psutil.NoSuchProcess, TypeError, ValueError):
        return False
    try:
        started = datetime.fromisoformat(str(started_at)).timestamp()
    except ValueError:
        return True
    return proc.create_time() <= started + 1  # a pid reused by a later process is not the holder


class _Precondition(Exception):
    """S3 answered 412 Precondition Failed (or 409 for a conditional write in flight)."""


def _s3(fs: Any, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    """One S3 call on ``path`` (bucket/key) through s3fs's client; a failed condition becomes ``_Precondition``.

    s3fs turns S3's 412 Precondition Failed into FileExistsError, and 409 ConditionalRequestConflict (a conditional
    write racing another) into a ClientError or OSError that names it.
    """
    bucket, _, key = path.partition("/")
    try:
        return fs.call_s3(method, Bucket=bucket, Key=key, **kwargs)
    except FileExistsError as err:
        raise _Precondition(str(err)) from None
    except (OSError, ValueError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        if any(word in str(err) for word in ("Precondition", "pre-condition", "ConditionalRequestConflict", "412", "409")):
            raise _Precondition(str(err)) from None
        raise
