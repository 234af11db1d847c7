"""pipeline/triton/mps.py: the triton engine's private CUDA MPS daemon, and what is left of a dead owner's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipeline.triton.mps import CONTROL, FOLDER_PREFIX, PIPE_ENV, MpsDaemon


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_owners_daemon_folder_is_swept_and_a_live_ones_kept():
    dead = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{_dead_pid()}-"))
    alive = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
    try:
        (dead / "pipe").mkdir()
        swept = MpsDaemon(control=shutil.which(CONTROL)).sweep_stale()
        assert dead in swept and not dead.exists()
        assert alive.is_dir() and alive not in swept
    finally:
        shutil.rmtree(dead, ignore_errors=True)
        shutil.rmtree(alive, ignore_errors=True)


def test_without_the_control_binary_the_daemon_is_unavailable(monkeypatch):
    monkeypatch.delenv(PIPE_ENV, raising=False)
    monkeypatch.setenv("PATH", "")
    daemon = MpsDaemon()
    assert not daemon.available
    with pytest.raises(FileNotFoundError, match=f"{CONTROL} is not on PATH"):
        daemon.start()


def test_the_nodes_own_mps_is_used_as_it_is(monkeypatch, tmp_path):
    monkeypatch.setenv(PIPE_ENV, str(tmp_path))
    daemon = MpsDaemon(control="/nonexistent")
    assert daemon.start() == {} and daemon.folder is None
    daemon.stop()
    assert tmp_path.is_dir()
