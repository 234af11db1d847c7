"""A real local Ray cluster for tests that submit jobs: `ray start --head` on loopback, stopped by process id.

Its own temp dir and free ports for every listener, so it never meets another Ray instance on the
machine; stopping it kills only the processes that carry that temp dir (and their children), never
`ray stop`, which would stop every Ray on the machine.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
NUM_CPUS = 2
OBJECT_STORE_BYTES = 400 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRayCluster:
    """`ray start --head` with a fixed small resource set (by default); ``address`` is the job API (dashboard) URL,
    ``gcs_address`` what a driver joins (RAY_ADDRESS); ``object_store_bytes`` None leaves Ray's own default;
    ``job_api`` False starts no dashboard (no job submission; Ray without its dashboard packages can run it)."""

    def __init__(self, num_cpus: int = NUM_CPUS, object_store_bytes: int | None = OBJECT_STORE_BYTES,
                 job_api: bool = True) -> None:
        self.num_cpus, self.object_store_bytes, self.job_api = num_cpus, object_store_bytes, job_api
        # Short path: Ray's unix sockets live under it and must stay under 107 characters.
        self.temp_dir = tempfile.mkdtemp(prefix="bcray", dir="/tmp")
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.gcs_address = f"127.0.0.1:{self.gcs_port}"
        # Token auth on, with a token of its own: the same whatever ~/.ray/auth_token this machine has.
        self.token = secrets.token_hex(32)
        self.env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}
        self.env.pop("RAY_ADDRESS", None)
        self.env.pop("RAY_AUTH_TOKEN_PATH", None)

    def ray(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """Run the real `ray` CLI of this venv against this cluster."""
        exe = shutil.which("ray", path=str(VENV_BIN)) or "ray"
        return subprocess.run([exe, *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=check)

    def start(self) -> None:
        self.ray(
            "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(self.gcs_port),
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
            "--include-dashboard", str(self.job_api).lower(), "--ray-client-server-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()), "--num-cpus", str(self.num_cpus), "--num-gpus", "0",
            *(("--object-store-memory", str(self.object_store_bytes)) if self.object_store_bytes else ()),
            "--disable-usage-stats", "--temp-dir", self.temp_dir,
        )
        if self.job_api:
            self._wait_for_job_api()

    def _wait_for_job_api(self, timeout_s: float = 60) -> None:
        import urllib.request

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                req = urllib.request.Request(f"{self.address}/api/version",
                                             headers={"Authorization": f"Bearer {self.token}"})
                urllib.request.urlopen(req, timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"Ray job API at {self.address} not up in {timeout_s} s; "
                           f"see {self.temp_dir}/session_latest/logs")

    def client(self):
        """A JobSubmissionClient of this cluster, its token passed explicitly."""
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.address, headers={"Authorization": f"Bearer {self.token}"})

    def job_status(self, submission_id: str) -> str:
        return str(self.client().get_job_status(submission_id).value)

    def processes(self) -> list:
        """This cluster's processes: those naming its temp dir, and all their descendants."""
        import psutil

        roots = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(self.temp_dir in part for part in (p.info["cmdline"] or [])):
                    roots.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        found = {p.pid: p for p in roots}
        for p in roots:
            try:
                found.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.NoSuchProcess:
                continue
        found.pop(os.getpid(), None)
        return list(found.values())

    def stop(self) -> None:
        import psutil

        procs = self.processes()
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _gone, alive = psutil.wait_procs(procs, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
