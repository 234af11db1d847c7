"""Hostile but ordinary use (issue 22): each reproduction run for real, asserting the right rows or one line."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.dataset as pads
import pytest

from conftest import make_jpeg
from ray_cluster import LocalRayCluster, ray_cluster  # noqa: F401  (session fixture: a live cluster not ours)

CLI = [sys.executable, "-m", "pipeline.cli"]


def write_images(folder: Path, n: int, seed: int = 0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = folder / f"img{i:04d}.jpg"
        path.write_bytes(make_jpeg(seed + i))
        paths.append(path)
    return paths


def rows(output: Path) -> list[dict]:
    return pads.dataset(str(output), format="parquet").to_table(columns=["uri", "status"]).to_pylist()


def cli_env() -> dict[str, str]:
    """The environment of a run as a user starts it: a local Ray of its own, none of this session's settings."""
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "RAY_enable_metrics_collection", "RAY_enable_open_telemetry",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(key, None)
    return env


# ---- the Ray/process side: loopback only, nothing left behind, bounds, a lost node -----------------------------

LOOPBACK_IPS = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def tree(pid: int) -> list:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def listeners(procs) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``procs``."""
    import psutil

    found = set()
    for proc in procs:
        try:
            name = proc.name()
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((name, conn.laddr.ip, conn.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def session_processes(session: str) -> list:
    """The live processes whose command line names Ray session folder ``session``, and their children."""
    import psutil

    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if session in " ".join(proc.info["cmdline"] or []):
                found[proc.pid] = proc
                found.update({c.pid: c for c in proc.children(recursive=True)})
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [p for p in found.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def ray_session_of(pid: int) -> str | None:
    """The Ray session folder that the local Ray of driver ``pid`` runs in, once its raylet is up."""
    import re

    from pipeline.job.local_ray import SESSION_DIR

    for proc in tree(pid):
        try:
            if "raylet" in proc.name():
                found = SESSION_DIR.search(" ".join(proc.cmdline()))
                if found and re.search(rf"_{pid}$", found.group(0)):
                    return found.group(0)
        except Exception:  # noqa: BLE001 - a process that just ended
            continue
    return None


def owned_folders(pids) -> list[Path]:
    """The engine repositories and Triton work folders of processes ``pids`` under the temp folder."""
    from pipeline.triton.workdirs import REPOSITORY_PREFIX, WORKDIR_PREFIX

    tmp = Path(tempfile.gettempdir())
    return [p for prefix in (REPOSITORY_PREFIX, WORKDIR_PREFIX) for pid in pids
            for p in tmp.glob(f"{prefix}{pid}-*")]


def test_only_temp_folders_of_dead_owners_are_swept(tmp_path):
    """The sweep removes this user's ``<prefix><pid>-*`` folders whose pid is gone, and nothing else: not a live
    owner's, not a name without a pid, not a file."""
    from pipeline.triton.workdirs import WORKDIR_PREFIX, owned_temp_folder, sweep_dead_owner_folders

    gone = subprocess.Popen(["true"])
    gone.wait()
    tmp = Path(tempfile.gettempdir())
    dead = tmp / f"{WORKDIR_PREFIX}{gone.pid}-hostile"
    (dead / "backends").mkdir(parents=True)
    (dead / "tritonserver.log").write_text("left by a SIGKILLed actor")
    live = owned_temp_folder(WORKDIR_PREFIX)
    unnamed = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}x"))
    stray_file = tmp / f"{WORKDIR_PREFIX}{gone.pid}-file"
    stray_file.write_text("not a folder")
    try:
        removed = sweep_dead_owner_folders(WORKDIR_PREFIX)
        assert dead.name in removed and not dead.exists()
        assert live.exists() and unnamed.exists() and stray_file.exists()
        assert live.name not in removed
    finally:
        for path in (dead, live, unnamed):
            shutil.rmtree(path, ignore_errors=True)
        stray_file.unlink(missing_ok=True)


def test_a_default_run_listens_on_loopback_only(tmp_path):
    """Reproduction 6: every listening socket of the job's process tree (driver, GCS, raylet, agents, workers,
    autoscaler and dashboard metrics) is on 127.0.0.1 or ::1, sampled while the run lives."""
    src = tmp_path / "src"
    write_images(src, 40)
    out = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "run", str(src), "--output", str(out), "-q"], env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[tuple[str, str, int]] = set()
    while proc.poll() is None:
        seen |= listeners(tree(proc.pid))
        time.sleep(0.5)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr
    assert len(rows(out)) == 40
    names = {name for name, _ip, _port in seen}
    # The sampling saw Ray's servers, or it proves nothing.
    assert {"gcs_server", "raylet"} <= names, seen
    assert any(name.startswith("ray::") for name in names), seen
    wide = sorted(s for s in seen if s[1] not in LOOPBACK_IPS)
    assert not wide, f"listening beyond loopback: {wide}"


def mark_as_dead_run(cluster) -> None:
    """Give a running ``ray start`` cluster the owner mark of a bulk-classify driver that has died: real Ray
    processes that outlived their driver, as a driver killed with SIGKILL can leave them."""
    import json

    from pipeline.job.local_ray import OWNER_FILE

    gone = subprocess.Popen(["true"])
    gone.wait()
    session = Path(cluster.temp_dir, "session_latest").resolve()
    (session / OWNER_FILE).write_text(json.dumps({"pid": gone.pid, "started": 0.0}))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_after_kill_9_of_the_driver_the_next_run_starts_clean(tmp_path, ray_cluster):  # noqa: F811
    """Reproduction 6: a driver killed with SIGKILL mid-run (Triton engine) leaves its Triton folders, and can leave
    its Ray's agents running; the next run ends those processes and removes those folders before its own Ray starts,
    and touches no process or folder of a live owner (``ray_cluster``: a live cluster without our mark)."""
    from pipeline.triton.workdirs import REPOSITORY_PREFIX, owned_temp_folder

    src = tmp_path / "src"
    write_images(src, 200)
    live_folder = owned_temp_folder(REPOSITORY_PREFIX)  # ours, alive: must survive the sweep
    doomed = LocalRayCluster()
    victim = subprocess.Popen([*CLI, "run", str(src), "--output", str(tmp_path / "out1"), "-q",
                               "--engine", "triton", "--batch-size", "8"], env=cli_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        session, folders = None, []
        while time.time() < deadline and victim.poll() is None:
            session = session or ray_session_of(victim.pid)
            folders = owned_folders([p.pid for p in tree(victim.pid)])
            if session and len(folders) >= 2:  # the engine's repository and its server's work folder
                break
            time.sleep(1)
        assert victim.poll() is None and session and len(folders) >= 2, "the run ended or never started Triton"
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        try:
            doomed.start()
        except subprocess.CalledProcessError as err:  # a loaded machine: ray start's raylet missed its 30 s
            pytest.fail(f"ray start failed: {err.stderr[-1500:]}")
        mark_as_dead_run(doomed)
        assert doomed.processes() and all(f.exists() for f in folders)  # what the next run must clean up
        bystanders = ray_cluster.processes()
        assert bystanders

        nxt = subprocess.Popen([*CLI, "run", str(src), "--output", str(tmp_path / "out2"), "-q"], env=cli_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The sweep runs before the next run's own Ray starts: by the time its raylet is up, nothing is left.
        deadline = time.time() + 300
        while nxt.poll() is None and ray_session_of(nxt.pid) is None and time.time() < deadline:
            time.sleep(0.5)
        left = [(p.pid, p.name()) for p in session_processes(session) + doomed.processes()]
        gone = [f for f in folders if f.exists()]
        _out, err = nxt.communicate(timeout=600)
        assert nxt.returncode == 0, err
        assert not left, f"processes of dead runs still alive: {left}"
        assert not gone, f"folders of the killed run still there: {gone}"
        assert live_folder.exists(), "a folder of a live owner was removed"
        assert all(p.is_running() for p in bystanders), "a process of a live cluster was ended"
        assert len(rows(tmp_path / "out2")) == 200
    finally:
        if victim.poll() is None:
            victim.kill()
        doomed.stop()
        shutil.rmtree(live_folder, ignore_errors=True)


@pytest.mark.slow
def test_a_triton_run_leaves_no_temp_folders(tmp_path):
    """Reproduction 6: ``--engine triton`` ends with its engines' repositories and server folders removed."""
    src = tmp_path / "src"
    write_images(src, 30)
    out = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "run", str(src), "--output", str(out), "-q", "--engine", "triton"],
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: set[int] = set()
    while proc.poll() is None:
        pids |= {p.pid for p in tree(proc.pid)}
        time.sleep(0.5)
    _out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert len(rows(out)) == 30
    assert len(pids) > 3  # the driver, Ray's daemons and the classify actor were seen
    assert not owned_folders(pids), owned_folders(pids)


def test_more_actors_than_the_cluster_holds_are_clamped_with_a_warning():
    """Reproduction 8, the plan: on 2 CPUs at most 5 classify actors of 0.25 CPU fit beside the listing, fetch and
    write tasks; on 2 GPUs at most 2 actors of one GPU each."""
    from pipeline.config import RunConfig
    from pipeline.job.stages import IO_TASK_CPUS, actor_plan

    actors, actor_cpus, gpus = actor_plan(RunConfig(source="/s", output="/o", num_actors=8), 2, 0)
    assert (actors, actor_cpus, gpus) == (5, 0.25, 0.0)
    assert actors * actor_cpus + 3 * IO_TASK_CPUS <= 2
    assert actor_plan(RunConfig(source="/s", output="/o", num_actors=3), 8, 0)[0] == 3  # fits: unchanged
    assert actor_plan(RunConfig(source="/s", output="/o", num_actors=4, num_gpus_per_actor=1.0), 16, 2)[0] == 2


@pytest.mark.timeout(900)
def test_num_actors_8_on_2_cpus_answers_instead_of_hanging(ray_local, tmp_path, caplog):
    """Reproduction 8: ``--num-actors 8`` on a 2-CPU Ray finishes every row, with one warning naming the clamp."""
    from pipeline.config import RunConfig
    from pipeline.job import run_job

    src = tmp_path / "src"
    write_images(src, 24)
    with caplog.at_level(logging.WARNING, logger="pipeline.job.stages"):
        summary = run_job(RunConfig(source=str(src), output=str(tmp_path / "out"), num_actors=8, batch_size=4))
    assert summary.total == 24 and len(rows(tmp_path / "out")) == 24
    warned = [r.getMessage() for r in caplog.records if "--num-actors 8" in r.getMessage()]
    assert warned == ["--num-actors 8: this Ray cluster (2 CPUs, 0 GPUs) holds at most 5 classify actors beside the "
                      "listing, fetch and write tasks; running 5"]


def _raylet_children(node) -> list:
    """The processes under a ``ray.cluster_utils`` node's raylet (its workers and agents)."""
    from ray._private import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
    return tree(raylet.pid)[1:]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_worker_node_lost_mid_run_leaves_every_input_exactly_once(tmp_path):
    """A lost node (spot preemption): a local cluster of a head and two worker raylets (``ray.cluster_utils``); the
    worker running a classify actor is killed once shards are committed. The run finishes, or fails and a rerun
    resumes; at the end every input has exactly one row."""
    from ray.cluster_utils import Cluster

    n = 480
    src = tmp_path / "src"
    names = sorted(p.name for p in write_images(src, n))
    out = tmp_path / "out"
    loopback = {"node_ip_address": "127.0.0.1", "object_store_memory": 150 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **loopback})
    try:
        workers = [cluster.add_node(num_cpus=2, **loopback) for _ in range(2)]
        # The driver joins the cluster as a client; Ray's loopback switch makes it find its raylet on 127.0.0.1.
        env = dict(cli_env(), RAY_ADDRESS=cluster.address, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        cmd = [*CLI, "run", str(src), "--output", str(out), "-q", "--num-actors", "2", "--batch-size", "8",
               "--shard-size", "16"]
        first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 900
        victim, seen_at = None, None
        while first.poll() is None and time.time() < deadline:
            victim = victim or next((w for w in workers if any("ClassifyActor" in " ".join(p.cmdline())
                                                               for p in _raylet_children(w))), None)
            seen_at = seen_at or (time.time() if victim is not None else None)
            # Lost while classifying: once a shard is committed, or a few seconds into the actor's work.
            if victim is not None and (list(out.glob("*/part-*.parquet")) or time.time() - seen_at > 5):
                break
            time.sleep(0.2)
        assert first.poll() is None and victim is not None, "the run ended before a node could be lost"
        committed_before = len(list(out.glob("*/part-*.parquet")))
        assert committed_before < n // 16, "every shard was committed before the node was lost"
        cluster.remove_node(victim, allow_graceful=False)
        _out, err = first.communicate(timeout=900)
        first_err = err.strip().splitlines()[-1:] if err.strip() else []
        outcomes = [first.returncode]
        while outcomes[-1] != 0 and len(outcomes) < 3:  # failed: resume, as a user (or the nightly) would
            again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            outcomes.append(again.returncode)
            err = again.stderr
        assert outcomes[-1] == 0, f"runs exited {outcomes}; last stderr: {err[-2000:]}"
        print(f"lost a node after {committed_before} shard(s); the runs exited {outcomes}; {first_err}")  # with -s
        got = rows(out)
        uris = [r["uri"] for r in got]
        assert len(uris) == len(set(uris)) == n, f"{len(uris)} rows, {len(set(uris))} distinct, after runs {outcomes}"
        assert sorted(u.rsplit("/", 1)[-1] for u in uris) == names
        assert {r["status"] for r in got} == {"ok"}
    finally:
        cluster.shutdown()
