"""Actor-per-server wiring: several Triton actors in one job, each with its own local server on loopback."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pyarrow.dataset as pads

from conftest import PHOTOS, make_jpeg
from pipeline.config import RunConfig
from pipeline.job import run_job


def tritonservers() -> list[psutil.Process]:
    """tritonserver processes of classify actors under this test session's raylet (others may run servers too)."""
    import ray

    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    found = []
    for p in psutil.process_iter(["name"]):
        try:
            actor = p.parent()
            if p.info["name"] == "tritonserver" and actor.ppid() == raylet and "ClassifyActor" in " ".join(
                    actor.cmdline()):
                found.append(p)
        except (psutil.Error, AttributeError):
            continue
    return found


def test_two_triton_actors_run_two_loopback_servers_and_leave_nothing_behind(ray_local, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for p in PHOTOS.glob("*.jpg"):
        (src / p.name).write_bytes(p.read_bytes())
    for i in range(40):
        (src / f"small{i:03d}.jpg").write_bytes(make_jpeg(i))
    before = {p.pid for p in tritonservers()}
    shm_before = set(Path("/dev/shm").glob("bulkcls_*"))
    seen: dict[int, set[str]] = {}
    parents: dict[int, int] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for proc in tritonservers():
                if proc.pid in before:
                    continue
                try:
                    addrs = {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
                except psutil.Error:
                    continue
                seen.setdefault(proc.pid, set()).update(addrs)
                parents[proc.pid] = proc.ppid()
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        summary = run_job(RunConfig(source=str(src), output=str(tmp_path / "out"), engine="triton", num_actors=2,
                                    batch_size=16, shard_size=40))
    finally:
        stop.set()
        watcher.join()

    assert summary.counts == {"ok": 50, "error": 0}
    uris = pads.dataset(str(tmp_path / "out"), format="parquet").to_table(columns=["uri"]).column("uri").to_pylist()
    assert len(uris) == len(set(uris)) == 50
    assert len(seen) == 2, f"expected one server per actor, saw {seen} with parents {parents}"
    for pid, addrs in seen.items():
        assert addrs and addrs <= {"127.0.0.1", "::ffff:127.0.0.1"}, f"server {pid} listens on {addrs}"
    deadline = time.time() + 30
    while time.time() < deadline and any(psutil.pid_exists(pid) for pid in seen):
        time.sleep(0.5)
    assert not any(psutil.pid_exists(pid) for pid in seen), "a tritonserver outlived the job"
    assert set(Path("/dev/shm").glob("bulkcls_*")) <= shm_before, "shared memory left behind"
