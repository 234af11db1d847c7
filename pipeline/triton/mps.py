"""A private CUDA MPS control daemon for one tritonserver, so its model instances' kernels share the GPU.

Without MPS a GPU time-slices between processes, and each python-backend instance of the gpu profile is its own
process: one instance's DALI kernels wait while another's network runs. Under MPS they run at once. The daemon's
pipe and log folders live in a folder of its own, so it touches neither a system-wide MPS nor the GPU's compute
mode; the server and its stubs reach it through ``CUDA_MPS_PIPE_DIRECTORY``/``CUDA_MPS_LOG_DIRECTORY``.
Where the node already runs MPS (those variables set), that one is used and nothing is started.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pipeline.node import pid_alive

LOG = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
FOLDER_PREFIX = "bulk-classify-mps-"
COMMAND_TIMEOUT_S = 30.0


class MpsDaemon:
    """Start with ``start()`` (returns the environment for the processes that should use it), stop with ``stop()``."""

    def __init__(self, control: str | None = None, gpus: str | None = None):
        self.control = control or shutil.which(CONTROL)
        self.folder: Path | None = None
        self.env: dict[str, str] = {}
        # The daemon sees the GPU(s) of the server it serves, as it would when started in that GPU's actor.
        self._daemon_env = {"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else {}

    @property
    def available(self) -> bool:
        return self.control is not None

    def start(self) -> dict[str, str]:
        """Starts the daemon (or finds the node's own); the variables its clients need. Raises OSError or
        subprocess.CalledProcessError when the daemon does not start."""
        if os.environ.get(PIPE_ENV):
            LOG.info("using the node's CUDA MPS at %s", os.environ[PIPE_ENV])
            return {}
        if self.control is None:
            raise FileNotFoundError(f"{CONTROL} is not on PATH")
        self.sweep_stale()
        self.folder = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))
        (self.folder / "pipe").mkdir()
        (self.folder / "log").mkdir()
        self.env = {PIPE_ENV: str(self.folder / "pipe"), LOG_ENV: str(self.folder / "log")}
        try:
            subprocess.run([self.control, "-d"], env={**os.environ, **self._daemon_env, **self.env}, check=True,
                           timeout=COMMAND_TIMEOUT_S, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except BaseException:
            self._remove()
            raise
        LOG.info("started a private CUDA MPS daemon in %s", self.folder)
        return dict(self.env)

    def stop(self) -> None:
        """Asks the daemon to quit (its server exits after its last client) and removes its folder."""
        if self.folder is None or self.control is None:
            return
        try:
            subprocess.run([self.control], input=b"quit\n", env={**os.environ, **self.env}, timeout=COMMAND_TIMEOUT_S,
                           check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as err:
            LOG.warning("CUDA MPS daemon in %s did not quit: %s", self.folder, err)
        self._remove()

    def sweep_stale(self) -> list[Path]:
        """Stops and removes the private daemons of processes that died without stopping theirs (a killed actor);
        the folders it removed."""
        swept = []
        for folder in Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*-*"):
            try:
                pid = int(folder.name[len(FOLDER_PREFIX):].split("-", 1)[0])
            except ValueError:
                continue
            if pid_alive(pid):
                continue
            env = {PIPE_ENV: str(folder / "pipe"), LOG_ENV: str(folder / "log")}
            try:
                if self.control is not None:
                    subprocess.run([self.control], input=b"quit\n", env={**os.environ, **env}, timeout=COMMAND_TIMEOUT_S,
                                   check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired):
                pass
            shutil.rmtree(folder, ignore_errors=True)
            swept.append(folder)
        if swept:
            LOG.info("stopped %d CUDA MPS daemon(s) of processes that are gone", len(swept))
        return swept

    def _remove(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
            self.env = {}

