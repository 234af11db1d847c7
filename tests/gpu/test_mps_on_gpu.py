"""pipeline/triton/mps.py on a real GPU: a CUDA process runs under the triton engine's private MPS daemon."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline.triton.mps import LOG_ENV, PIPE_ENV, MpsDaemon


def test_a_cuda_process_runs_under_the_private_daemon(monkeypatch):
    monkeypatch.delenv(PIPE_ENV, raising=False)
    daemon = MpsDaemon()
    env = daemon.start()
    folder = daemon.folder
    try:
        assert set(env) == {PIPE_ENV, LOG_ENV} and Path(env[PIPE_ENV]).is_dir()
        code = "import torch; x = torch.ones(1024, device='cuda'); print(float(x.sum()))"
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "1024.0", out.stderr[-2000:]
        assert "server" in (Path(env[LOG_ENV]) / "control.log").read_text().lower()  # it started an MPS server for us
    finally:
        daemon.stop()
    assert not folder.exists()
