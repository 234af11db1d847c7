"""The local Ray a run starts itself: its owner mark, and the sweep of what an earlier run killed with SIGKILL left
running or on disk (its environment, loopback only and no metrics, is ``pipeline.node.local_ray_env``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Iterator

from pipeline.node import pid_alive
from pipeline.triton.workdirs import sweep_stale_temp_folders

LOG = logging.getLogger(__name__)

LOCAL_ADDRESS = "local"  # ray.init's address for "start a new local Ray", never a `ray start` cluster found on disk
OWNER_FILE = "bulk_classify_owner.json"  # in the session folder of a local Ray we started: the driver's pid
# Ray names a session folder session_<date>_<time>_<microseconds>_<pid>; every process of a session names it.
SESSION_DIR = re.compile(r"/[^\s=:,]*/session_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}_\d+_\d+")


@contextlib.contextmanager
def ray_owned() -> Iterator[None]:
    """The Ray started or joined inside is shut down on the way out (its output, as Ray prints it, goes where the
    caller's stdout goes); a Ray that was already up, the caller's, is left as it is."""
    up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    try:
        yield
    finally:
        if not up and "ray" in sys.modules:
            import ray  # noqa: PLC0415 - only when the run started it

            if ray.is_initialized():
                ray.shutdown()


def mark_session(session_dir: str) -> None:
    """Record this process as the owner of the local Ray whose session folder is ``session_dir``."""
    import psutil

    record = {"pid": os.getpid(), "started": psutil.Process().create_time()}
    try:
        (Path(session_dir) / OWNER_FILE).write_text(json.dumps(record))
    except OSError as err:  # without the mark a later run only leaves this session's processes alone
        LOG.warning("cannot mark the local Ray session %s as ours: %s", session_dir, err)


def _dead_owner(session_dir: str) -> bool:
    try:
        record = json.loads((Path(session_dir) / OWNER_FILE).read_text())
        return not pid_alive(int(record["pid"]), float(record["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not a session we started, or not readable: never ours to end


def sweep_dead_sessions() -> list[int]:
    """SIGKILL the processes of local Rays that a bulk-classify driver started and that outlived it; their pids.

    A driver killed with SIGKILL can leave its Ray's agents (DashboardAgent, RuntimeEnvAgent) listening for a while.
    Only sessions carrying our owner mark, of owners that are gone, and processes of this user are touched: those
    that name the session folder and their children (Ray's workers rename themselves ``ray::…``).
    """
    import psutil

    verdict: dict[str, bool] = {}
    doomed: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != os.getuid():
                continue
            found = SESSION_DIR.search(" ".join(proc.info["cmdline"] or []))
            if found is None:
                continue
            session = found.group(0)
            if session not in verdict:
                verdict[session] = _dead_owner(session)
            if verdict[session]:
                doomed[proc.pid] = proc
                doomed.update({child.pid: child for child in proc.children(recursive=True)})
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    doomed.pop(os.getpid(), None)
    for proc in doomed.values():
        try:
            proc.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    if doomed:
        psutil.wait_procs(list(doomed.values()), timeout=5)
        LOG.warning("ended %d process(es) of a local Ray whose bulk-classify driver had died: pids %s",
                    len(doomed), ", ".join(map(str, sorted(doomed)[:10])))
    return sorted(doomed)


def sweep_before_start() -> None:
    """Clean up what runs killed with SIGKILL on this machine left: their Ray's processes, their Triton temp folders."""

    sweep_dead_sessions()
    sweep_stale_temp_folders()
