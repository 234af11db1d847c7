"""CUDA MPS (Multi-Process Service) for one benchmark step: several processes' kernels on the GPU at once.

Without MPS the GPU time-slices between processes (one CUDA context at a time), so one Triton model instance's DALI
kernels wait while another instance's network runs. Under MPS the kernels of all client processes share the SMs
like the streams of one process. ``mps()`` starts a private control daemon (its pipe and log folders under a temp
folder, so it touches no system-wide MPS) and exports ``CUDA_MPS_PIPE_DIRECTORY``/``CUDA_MPS_LOG_DIRECTORY`` to the
processes started inside the block (tritonserver and its stubs, Ray's workers); on leaving it asks the daemon to quit.
It changes no setting of the GPU (compute mode stays Default).

    with mps(Path("/tmp/mps")):
        run_the_server_and_clients()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def mps_available() -> bool:
    return shutil.which("nvidia-cuda-mps-control") is not None


@contextlib.contextmanager
def mps(folder: Path):
    """A private MPS control daemon for the processes started inside the block (see the module's docstring)."""
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        raise RuntimeError("nvidia-cuda-mps-control is not on PATH: MPS comes with the NVIDIA driver's utilities")
    pipe, logs = folder / "pipe", folder / "log"
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    values = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    env = {**os.environ, **values}
    subprocess.run([exe, "-d"], env=env, check=True, timeout=30)
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(values)
    try:
        yield logs
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        subprocess.run([exe], input=b"quit\n", env=env, timeout=30, check=False)
        time.sleep(2)  # the server exits after its last client: let the GPU settle before the next step


def log_tail(logs: Path, lines: int = 10) -> str:
    """The end of the daemon's and server's logs (what went wrong, when a client could not connect)."""
    out = []
    for name in ("control.log", "server.log"):
        path = logs / name
        if path.is_file():
            out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(out)
