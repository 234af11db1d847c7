"""One local tritonserver shared by the classify actors of one GPU (``--engine-option share_server=true``).

Several actors per GPU (``--num-gpus-per-actor 0.5``) each bring their own client process, so the gRPC work of
sending files spreads over several cores, while one server - one CUDA context, one request stream - keeps the GPU.
The first engine on a node to ask for a (repository, GPU, arguments) key starts the server and records it in a
small JSON file under the node's temp folder, holding an exclusive ``flock`` while it does; the others find it
there and connect. An engine whose shared server stopped answering takes the lease again: the server is found
restarted by its owner, or this engine starts a new one and becomes the owner.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence

LOG = logging.getLogger(__name__)

LEASE_DIR_NAME = "bulk-classify-shared-servers"


def lease_key(repository: str, server_args: Sequence[str], model_name: str) -> str:
    """Servers are shared by engines that would start the same one on the same GPU(s)."""
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    text = json.dumps([str(Path(repository).resolve()), list(server_args), model_name, gpus])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ServerLease:
    """The record of one shared server: who runs it (pid) and where (gRPC url)."""

    def __init__(self, key: str, folder: str | os.PathLike | None = None):
        self.key = key
        self.folder = Path(folder or Path(tempfile.gettempdir()) / LEASE_DIR_NAME)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.record = self.folder / f"{key}.json"
        self._lock_path = self.folder / f"{key}.lock"

    @contextmanager
    def _locked(self):
        with open(self._lock_path, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def read(self) -> dict | None:
        """The live server's record, or None when there is none or its process is gone."""
        try:
            info = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return None
        return info if _alive(int(info.get("pid", 0))) else None

    def acquire(self, start: Callable[[], object], exclude_url: str | None = None):
        """(url, server): a running shared server's url and None, or a server ``start()`` just started (we own it).

        ``exclude_url``: a url that just failed; a record still naming it (its process alive but not answering)
        is not trusted and a new server is started.
        """
        with self._locked():
            info = self.read()
            if info is not None and info.get("url") != exclude_url:
                LOG.info("sharing tritonserver %s (pid %s)", info["url"], info["pid"])
                return info["url"], None
            server = start()
            self.publish(server)
            LOG.info("started the shared tritonserver %s (pid %s)", server.grpc_url, server.pid)
            return server.grpc_url, server

    def publish(self, server) -> None:
        """Records (again, after a restart) the server this process owns."""
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": server.grpc_url, "pid": server.pid, "owner": os.getpid()}))
        tmp.replace(self.record)

    def release(self, server) -> None:
        """The owner stops sharing (before stopping the server): the record goes if it is still ours."""
        with self._locked():
            info = self.read()
            if info is None or info.get("pid") == server.pid:
                self.record.unlink(missing_ok=True)
