"""TritonServer against the real tritonserver of the nvidia-pytriton wheel: loopback, no clashes, clean stop,
restart after kill -9, errors with the log tail, and the child dying with its parent."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from pipeline.errors import TritonError
from pipeline.triton.server import BINARY_ENV, SHM_DIR, TritonServer, _free_ports, sweep_stale_shared_memory
from support.paths import REPO


# A tiny python-backend model: the server class knows nothing of profiles, and this one loads in a fraction
# of the classifier's time. It imports pipeline.errors to prove the stub sees this checkout.
ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
ECHO_MODEL = """
import os, sys
sys.path[:0] = [p for p in os.environ.get("BULK_CLASSIFY_PYTHONPATH", "").split(os.pathsep) if p]
import numpy as np
import triton_python_backend_utils as pb_utils
import pipeline.errors  # noqa: F401

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", (x * 2).astype(np.float32))]))
        return out
"""


def _write_repo(root: Path, model_py: str) -> Path:
    (root / "echo" / "1").mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (root / "echo" / "1" / "model.py").write_text(model_py)
    return root


@pytest.fixture(scope="module")
def echo_repo(tmp_path_factory) -> Path:
    return _write_repo(tmp_path_factory.mktemp("echo_repo"), ECHO_MODEL)


def _echo(server: TritonServer) -> np.ndarray:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    x = grpcclient.InferInput("X", [2, 3], "FP32")
    x.set_data_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    return client.infer("echo", [x]).as_numpy("Y")


def _tree(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def _gone(procs: list[psutil.Process], timeout_s: float = 10.0) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_two_servers_on_loopback_without_clashing_and_nothing_left_after_stop(echo_repo):
    with TritonServer(echo_repo) as first, TritonServer(echo_repo) as second:
        assert len({first.http_port, first.grpc_port, first.metrics_port,
                    second.http_port, second.grpc_port, second.metrics_port}) == 6
        assert first.shm_prefix != second.shm_prefix
        np.testing.assert_array_equal(_echo(first), np.arange(6, dtype=np.float32).reshape(2, 3) * 2)
        np.testing.assert_array_equal(_echo(second), np.arange(6, dtype=np.float32).reshape(2, 3) * 2)
        for server in (first, second):
            listening = [c.laddr for c in psutil.Process(server.pid).net_connections() if c.status == "LISTEN"]
            assert {addr.port for addr in listening} == {server.http_port, server.grpc_port, server.metrics_port}
            for addr in listening:
                ip = ipaddress.ip_address(addr.ip)
                ip = getattr(ip, "ipv4_mapped", None) or ip  # gRPC listens on ::ffff:127.0.0.1
                assert ip.is_loopback, f"tritonserver listens on {addr.ip}:{addr.port}"
        trees = [_tree(first.pid), _tree(second.pid)]
        assert all(len(tree) >= 2 for tree in trees), "each server should run a python backend stub"
        assert list(SHM_DIR.glob(first.shm_prefix + "*")) and list(SHM_DIR.glob(second.shm_prefix + "*"))
        prefixes = (first.shm_prefix, second.shm_prefix)
    assert _gone(trees[0] + trees[1])
    assert not [p for prefix in prefixes for p in SHM_DIR.glob(prefix + "*")]
    assert first.pid is None and not first.is_alive()


def test_kill_9_then_ensure_running_restarts_on_new_ports(echo_repo):
    with TritonServer(echo_repo) as server:
        old_tree = _tree(server.pid)
        old_prefix = server.shm_prefix
        assert server.ensure_running() is False  # healthy: nothing to do
        os.kill(server.pid, signal.SIGKILL)
        psutil.wait_procs(old_tree[:1], timeout=10)
        assert not server.is_ready()
        assert server.ensure_running() is True
        assert server.restarts == 1 and server.is_ready()
        assert server.pid != old_tree[0].pid
        assert _echo(server)[0, 1] == 2.0
        assert _gone(old_tree), "the stub of the killed server must not outlive it"
        assert not list(SHM_DIR.glob(old_prefix + "*"))


def test_failed_start_raises_with_the_model_error_from_the_log(tmp_path):
    repo = _write_repo(tmp_path, "raise RuntimeError('model file is broken on purpose')\n")
    with pytest.raises(TritonError, match=r"(?s)exited with code .*model file is broken on purpose"):
        TritonServer(repo, startup_timeout_s=60).start()


def test_readiness_timeout_says_what_to_raise_and_leaves_no_process(echo_repo):
    server = TritonServer(echo_repo, startup_timeout_s=0.05)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(TritonError, match=r"not ready after 0 s \(raise startup_timeout_s"):
        server.start()
    leftover = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert _gone(leftover)


def test_missing_repository_and_missing_binary_say_how_to_fix(tmp_path, monkeypatch):
    with pytest.raises(TritonError, match="is not a folder; build one with `bulk-classify repo build"):
        TritonServer(tmp_path / "nope")
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "no-tritonserver"))
    with pytest.raises(TritonError, match=f"does not exist; fix {BINARY_ENV}"):
        TritonServer(tmp_path)


def test_server_dies_with_its_parent(echo_repo, tmp_path):
    """PR_SET_PDEATHSIG: a killed actor must not leave its tritonserver running."""
    pid_file = tmp_path / "pid"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pipeline.triton.server import TritonServer
        server = TritonServer({str(echo_repo)!r}).start()
        open({str(pid_file)!r}, "w").write(str(server.pid))
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None, "the parent did not start a server"
            time.sleep(0.1)
        server_tree = _tree(int(pid_file.read_text()))
    finally:
        parent.kill()
        parent.wait()
    assert _gone(server_tree, timeout_s=15), "tritonserver outlived its killed parent"
    # Whatever the dead parent's server left in /dev/shm, the next start (or a sweep) removes.
    sweep_stale_shared_memory()
    assert not list(SHM_DIR.glob(f"bulkcls_{parent.pid}_*"))


def test_shared_memory_goes_with_a_server_killed_with_its_stubs_while_its_owner_cleans_nothing(echo_repo):
    """A server and its stubs SIGKILLed at once clean nothing, and an owner killed in the middle of its exit (Ray's
    kill of a slow worker) runs no stop(): the server's detached watcher removes its shared memory."""
    server = TritonServer(echo_repo).start()
    try:
        prefix = server.shm_prefix
        assert list(SHM_DIR.glob(prefix + "*")), "the echo model's server made no shared memory"
        os.killpg(server.pid, signal.SIGKILL)  # the server and its stubs; left a zombie: nothing here reaps it
        deadline = time.monotonic() + 15
        while list(SHM_DIR.glob(prefix + "*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not list(SHM_DIR.glob(prefix + "*")), "shared memory outlived its server"
    finally:
        server.stop()


def test_sweep_removes_only_regions_of_dead_processes():
    dead = subprocess.Popen(["true"])
    dead.wait()
    mine = [SHM_DIR / f"bulkcls_{os.getpid()}_test_a", SHM_DIR / f"bulkcls_{os.getpid()}_test_b"]
    stale = [SHM_DIR / f"bulkcls_{dead.pid}_test_c", SHM_DIR / f"bulkcls_{dead.pid}_test_d"]
    for path in mine + stale:
        path.write_bytes(b"x")
    try:
        removed = sweep_stale_shared_memory()
        assert {p.name for p in stale} <= set(removed)
        assert all(p.exists() for p in mine) and not any(p.exists() for p in stale)
    finally:
        for path in mine + stale:
            path.unlink(missing_ok=True)


def test_a_server_started_from_a_short_lived_thread_outlives_it(echo_repo):
    """PR_SET_PDEATHSIG follows the forking thread; servers are forked from one long-lived launcher thread."""
    import threading

    holder = {}
    thread = threading.Thread(target=lambda: holder.setdefault("server", TritonServer(echo_repo).start()))
    thread.start()
    thread.join()
    server = holder["server"]
    try:
        time.sleep(1.0)
        assert server.is_ready(), "the server died with the thread that started it"
    finally:
        server.stop()


def test_a_servers_ports_are_always_distinct():
    """HTTP, gRPC and metrics ports are picked together: picked one after another, a closed port can come back
    (1 start in about 2,000 here), and tritonserver then exits refusing HTTP and metrics on one port."""
    for _ in range(10):
        ports = _free_ports(200)
        assert len(set(ports)) == 200 and all(1024 <= p < 65536 for p in ports)
