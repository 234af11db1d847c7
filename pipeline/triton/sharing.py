"""One local tritonserver shared by the classify actors of one GPU (``--engine-option share_server=true``).

Several actors per GPU (``--num-gpus-per-actor 0.5``) each bring their own client process, so the gRPC work of
sending files spreads over several cores, while one server - one CUDA context, one request stream - keeps the GPU.
The first engine on a node to ask for a (repository, GPU, arguments) key starts the server and records it in a
small JSON file under the node's temp folder, holding an exclusive ``flock`` while it does; the others find it
there and connect. An engine whose shared server stopped answering takes the lease again: the server is found
restarted by its owner, or this engine starts a new one and becomes the owner. A server whose process lives is
never replaced (it is slow, and its owner restarts it if it hangs); one whose process is gone is replaced by its
owner, whom the others wait for while the owner's process lives.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence

from pipeline.node import pid_alive

LOG = logging.getLogger(__name__)

LEASE_DIR_NAME = "bulk-classify-shared-servers"
POLL_S = 0.5  # how often an engine waiting for the owner's restarted server reads the record
# How long an owner that is done keeps its server for the engines still using it: at the end of a job Ray Data
# releases whichever actor goes idle first, often the owner, while the others finish their last calls.
LINGER_S = 120.0


def lease_key(repository: str, server_args: Sequence[str], model_name: str, gpus: str | None = None) -> str:
    """Servers are shared by engines that would start the same one on the same GPU(s) (``gpus`` as
    CUDA_VISIBLE_DEVICES names them; default: this process's)."""
    gpus = gpus if gpus is not None else os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    text = json.dumps([str(Path(repository).resolve()), list(server_args), model_name, gpus])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _accepts(url: str, timeout_s: float = 2.0) -> bool:
    """Does anything accept a TCP connection at ``url`` (host:port)? A server that is only slow still does."""
    host, _, port = url.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False



class ServerLease:
    """The record of one shared server: who runs it (pid) and where (gRPC url)."""

    def __init__(self, key: str, folder: str | os.PathLike | None = None):
        self.key = key
        self.folder = Path(folder or Path(tempfile.gettempdir()) / LEASE_DIR_NAME)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.record = self.folder / f"{key}.json"
        self._lock_path = self.folder / f"{key}.lock"
        self._users = self.folder / f"{key}.users"  # one empty file per engine process using the server, named by pid

    @contextmanager
    def _locked(self):
        with open(self._lock_path, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _record_text(self) -> dict | None:
        try:
            return json.loads(self.record.read_text())
        except (OSError, ValueError):
            return None

    def read(self) -> dict | None:
        """The live server's record, or None when there is none or its process is gone."""
        info = self._record_text()
        return info if info is not None and pid_alive(int(info.get("pid", 0))) else None

    def join(self) -> None:
        """Records this process as a user of the server (the owner waits for its users before stopping it)."""
        self._users.mkdir(parents=True, exist_ok=True)
        (self._users / str(os.getpid())).touch()

    def leave(self) -> None:
        """This process no longer uses the server."""
        (self._users / str(os.getpid())).unlink(missing_ok=True)

    def other_users(self) -> list[int]:
        """The live processes other than this one that use the server (the files of dead ones are removed)."""
        users = []
        for entry in self._users.glob("*") if self._users.is_dir() else ():
            try:
                pid = int(entry.name)
            except ValueError:
                continue
            if pid == os.getpid():
                continue
            if pid_alive(pid):
                users.append(pid)
            else:
                entry.unlink(missing_ok=True)
        return users

    def acquire(self, start: Callable[[], object], exclude_url: str | None = None, wait_s: float = 0.0):
        """(url, server): a running shared server's url and None, or a server ``start()`` just started (we own it).

        ``exclude_url``: a url that just failed. While the recorded server's process lives it is only slow: its
        url comes back (the caller keeps waiting on it). When that process is gone and the record's owner lives,
        the owner's restarted server is waited for, up to ``wait_s``; a new server is started only after that, or
        when the owner is gone too.
        """
        with self._locked():
            info = self.read()
            if info is not None and info.get("url") == exclude_url and (info.get("closing")
                                                                       or not _accepts(exclude_url)):
                # Its process lives but it refuses connections: it is shutting down (its owner is done), not slow.
                LOG.info("shared tritonserver %s is shutting down; starting another", exclude_url)
                server = start()
                self.publish(server)
                return server.grpc_url, server
            if info is not None:
                if info.get("url") != exclude_url:
                    LOG.info("sharing tritonserver %s (pid %s)", info["url"], info["pid"])
                return info["url"], None
            record = self._record_text() or {}
            # An owner that is closing restarts nothing: waiting for it would only stall its users.
            owner = 0 if record.get("closing") else int(record.get("owner", 0))
        deadline = time.monotonic() + wait_s
        while exclude_url is not None and owner and pid_alive(owner) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            info = self.read()
            if info is not None:
                LOG.info("sharing tritonserver %s (pid %s), restarted by its owner", info["url"], info["pid"])
                return info["url"], None
        with self._locked():
            info = self.read()
            if info is not None:
                return info["url"], None
            server = start()
            self.publish(server)
            LOG.info("started the shared tritonserver %s (pid %s)", server.grpc_url, server.pid)
            return server.grpc_url, server

    def publish(self, server) -> None:
        """Records (again, after a restart) the server this process owns."""
        self._write({"url": server.grpc_url, "pid": server.pid, "owner": os.getpid()})

    def _write(self, info: dict) -> None:
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(self.record)

    def release(self, server, linger_s: float = LINGER_S) -> None:
        """The owner stops sharing (before stopping the server): it waits up to ``linger_s`` for the other users
        to leave, then the record goes if it is still ours."""
        self.leave()
        with self._locked():
            info = self._record_text()
            if info is not None and info.get("pid") == server.pid:
                self._write({**info, "closing": True})
        deadline = time.monotonic() + linger_s
        while time.monotonic() < deadline:
            users = self.other_users()
            if not users:
                break
            time.sleep(POLL_S)
        else:
            # With no linger the owner knows its users are done (the driver at the job's end): not worth a warning.
            (LOG.warning if linger_s > 0 else LOG.info)(
                "stopping the shared tritonserver %s with %d engine(s) still using it", server.grpc_url,
                len(self.other_users()))
        with self._locked():
            info = self.read()
            if info is None or info.get("pid") == server.pid:
                self.record.unlink(missing_ok=True)
