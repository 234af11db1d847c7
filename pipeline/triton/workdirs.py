"""The temp folders of Triton engines and servers: named after their owner's pid, swept once that owner is gone."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from pipeline.node import pid_alive

LOG = logging.getLogger(__name__)

# Each is followed by the owner's pid and "-" (owned_temp_folder), under the temp folder of the node.
REPOSITORY_PREFIX = "bulk-classify-repo-"  # the portable repository a Triton engine builds for its own server
WORKDIR_PREFIX = "bulk-classify-triton-"  # a tritonserver's work folder: its log and backends


def owned_temp_folder(prefix: str) -> Path:
    """A new folder under the temp folder named ``<prefix><pid>-…``, so a later process can tell when its owner died."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def sweep_dead_owner_folders(prefix: str) -> list[str]:
    """Removes this user's ``owned_temp_folder(prefix)`` folders whose owner process is gone (a SIGKILLed run, or an
    actor Ray ended without running its exit handlers); their names."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(prefix + "*"):
        pid_text = path.name[len(prefix):].split("-")[0]
        try:
            if not pid_text.isdigit() or not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if pid_alive(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    if removed:
        LOG.info("removed %d temp folder(s) of dead processes: %s", len(removed), ", ".join(removed[:5]))
    return removed


def sweep_stale_temp_folders() -> None:
    """Removes the repositories and server work folders that engines of dead processes left on this node."""
    sweep_dead_owner_folders(REPOSITORY_PREFIX)
    sweep_dead_owner_folders(WORKDIR_PREFIX)
