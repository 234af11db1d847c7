"""Actor-per-server wiring: several Triton actors in one job, each with its own local server on loopback."""

from __future__ import annotations

import os
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

    max_alive = [0]

    def watch() -> None:
        while not stop.is_set():
            alive = tritonservers()
            max_alive[0] = max(max_alive[0], len(alive))
            for proc in alive:
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
    # Two actors, two servers alive at once, one per actor (no restarts); every listening socket on loopback.
    # (On a loaded machine the second actor's server may still be starting when the first finishes the work.)
    assert max_alive[0] == 2 and len(seen) == 2, f"saw {seen} with parents {parents}"
    assert len(set(parents.values())) == 2, f"one server per actor expected, parents {parents}"
    listening = {pid: addrs for pid, addrs in seen.items() if addrs}
    assert listening, "no server was seen listening"
    for pid, addrs in listening.items():
        assert addrs <= {"127.0.0.1", "::ffff:127.0.0.1"}, f"server {pid} listens on {addrs}"
    deadline = time.time() + 30
    while time.time() < deadline and any(psutil.pid_exists(pid) for pid in seen):
        time.sleep(0.5)
    assert not any(psutil.pid_exists(pid) for pid in seen), "a tritonserver outlived the job"
    # An actor removes its server's shared memory as it exits, or the server's watcher does once the server is
    # gone: either may come a few seconds after the job returns.
    actors = {str(pid) for pid in parents.values()}

    def ours() -> list[str]:  # bulkcls_<pid of the actor that started the server>_…
        return [p.name for p in set(Path("/dev/shm").glob("bulkcls_*")) - shm_before if actors & set(p.name.split("_"))]

    deadline = time.time() + 30
    while time.time() < deadline and ours():
        time.sleep(0.5)
    assert not ours(), f"shared memory left behind: {ours()}"


def test_the_driver_starts_the_shared_server_while_ray_starts_and_the_actors_share_it(ray_local, tmp_path,
                                                                                      monkeypatch):
    """Where the actors share a server (the gpu profile's default; share_server=true here), the driver of a local Ray
    starts it before any actor exists: both actors use it and start none, and it is gone once the run returns."""
    from pipeline.triton import client as triton_client

    src = tmp_path / "src"
    src.mkdir()
    for i in range(50):
        (src / f"small{i:03d}.jpg").write_bytes(make_jpeg(i))
    driver_servers = []
    stop = triton_client.NodeServers._stop

    def recording_stop(self):
        for thread in self._threads:
            thread.join()
        driver_servers.extend((e.server.pid, psutil.Process(e.server.pid).ppid()) for e in self.engines)
        stop(self)

    monkeypatch.setattr(triton_client.NodeServers, "_stop", recording_stop)
    summary = run_job(RunConfig(source=str(src), output=str(tmp_path / "out"), engine="triton", num_actors=2,
                                batch_size=8, shard_size=25, engine_options={"share_server": True}))

    assert summary.counts == {"ok": 50, "error": 0}
    assert len(driver_servers) == 1 and driver_servers[0][1] == os.getpid(), driver_servers
    events = summary.report["engine_events"]
    # One start in the whole run, the driver's: neither actor started a server of its own, none failed over.
    assert events[triton_client.EVENT_STARTS] == 1 and triton_client.EVENT_FAILOVERS not in events, events
    assert events[triton_client.EVENT_CHECKED] == 50
    assert not psutil.pid_exists(driver_servers[0][0]), "the driver's tritonserver outlived the run"


def test_killing_an_actors_tritonserver_mid_job_loses_no_row(ray_local, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    # Photo-sized noise (~4 ms each to decode and resize here): the work after the first committed shard lasts
    # seconds, so the kill lands mid-job. With 48x40 images the whole job was one burst at the end of start-up.
    for i in range(360):
        (src / f"img{i:03d}.jpg").write_bytes(make_jpeg(i, size=(640, 640)))
    out = tmp_path / "out"
    result = {}

    def job() -> None:
        result["summary"] = run_job(RunConfig(source=str(src), output=str(out), engine="triton", num_actors=1,
                                              batch_size=8, shard_size=16))

    runner = threading.Thread(target=job)
    runner.start()
    killed = None
    deadline = time.time() + 240
    while time.time() < deadline and killed is None and runner.is_alive():
        servers = tritonservers()
        if servers and list(out.rglob("part-*.parquet")):
            killed = servers[0].pid
            servers[0].kill()
        time.sleep(0.1)
    runner.join(300)
    assert killed is not None, "the job ended before its server could be killed"
    assert result["summary"].counts == {"ok": 360, "error": 0}
    uris = pads.dataset(str(out), format="parquet").to_table(columns=["uri"]).column("uri").to_pylist()
    assert len(uris) == len(set(uris)) == 360
    assert not psutil.pid_exists(killed) or psutil.Process(killed).status() == psutil.STATUS_ZOMBIE
