"""Every Triton answer is checked (TAG in, ECHO out), and a shared server fails over only when it is really gone.

Real tritonservers of the portable profile on the CPU: models that answer for the wrong images, client timeouts,
servers killed mid-request and servers stopped (SIGSTOP: alive but not answering) under many clients, threads and
processes. Each image is drawn at its own size, so the answer's (width, height) says which image it was made for.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import make_jpeg
from pipeline.triton import client as triton_client
from pipeline.engines.registry import make_engine
from pipeline.errors import ModelError, TritonError
from pipeline.model.folder import load_model
from pipeline.triton import contract as tn, server as triton_server, sharing
from pipeline.triton.checks import check_repository
from pipeline.triton.repository import build_repository
from support.paths import TESTS

TOP_K = 5


@pytest.fixture(scope="module")
def bundle():
    return load_model(None)


def _size(i: int) -> tuple[int, int]:
    """Image i's own (width, height): no two images of a test share one."""
    return 24 + i % 97, 20 + i // 97


def _images(start: int, n: int) -> list[bytes]:
    return [make_jpeg(start + i, size=_size(start + i)) for i in range(n)]


def _own(rows, start: int) -> list[int]:
    """The images (by number) whose row is an ok answer made for another image: must be empty."""
    return [start + i for i, r in enumerate(rows) if r.status == "ok" and (r.width, r.height) != _size(start + i)]


@pytest.fixture()
def lease_dir(tmp_path, monkeypatch):
    """Shared-server records of this test only (subprocesses get the same folder through TMPDIR)."""
    folder = tmp_path / "leases"
    folder.mkdir()
    monkeypatch.setattr(sharing.tempfile, "gettempdir", lambda: str(folder))
    return folder


# A portable model that answers with another request's outputs: every ``mix_every``-th response it sends is the
# previous request's (a stale answer, for other images). 0 never mixes.
MIXING_MODEL = '''
import json, os, sys
sys.path[:0] = [p for p in os.environ.get("BULK_CLASSIFY_PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
import triton_python_backend_utils as pb_utils
from pipeline.triton.serve.portable_model import TritonPythonModel as Portable

class TritonPythonModel(Portable):
    def initialize(self, args):
        super().initialize(args)
        self.every = int(json.loads(args["model_config"])["parameters"]["mix_every"]["string_value"])
        self.sent = 0
        self.previous = None

    def execute(self, requests):
        out = []
        for response in super().execute(requests):
            tensors = [(t.name(), t.as_numpy()) for t in response.output_tensors()]
            self.sent += 1
            if self.every and self.sent % self.every == 0 and self.previous is not None:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in self.previous]))
            else:
                out.append(response)
            self.previous = tensors or self.previous
        return out
'''


def _mixing_repo(path: Path, every: int) -> Path:
    repo = build_repository("portable", None, str(path), top_k=TOP_K)
    model = repo / tn.MODEL_NAME
    (model / "1" / "model.py").write_text(MIXING_MODEL)
    config = model / "config.pbtxt"
    config.write_text(config.read_text() + f'parameters {{ key: "mix_every" value {{ string_value: "{every}" }} }}\n')
    return repo


def test_answers_for_other_images_are_retried_and_never_taken(bundle, tmp_path):
    blobs = _images(0, 40)
    clean = make_engine("triton", bundle, top_k=TOP_K, repository=str(_mixing_repo(tmp_path / "clean", 0)),
                        request_batch=4, concurrency=1)
    try:
        want = clean.classify(blobs)
        assert clean.events[triton_client.EVENT_CHECKED] == len(blobs)
        assert clean.events[triton_client.EVENT_MISMATCHES] == 0
    finally:
        clean.close()
    mixing = make_engine("triton", bundle, top_k=TOP_K, repository=str(_mixing_repo(tmp_path / "mix", 3)),
                         request_batch=4, concurrency=1)
    try:
        got = mixing.classify(blobs)
        events = dict(mixing.events)
    finally:
        mixing.close()
    # one request at a time: sends 3, 6, 9 and 12 were the request before's answer; 14 sends for 10 requests
    assert events[triton_client.EVENT_MISMATCHES] == 4, events
    assert [r.status for r in got] == ["ok"] * len(blobs), [r.error for r in got if r.error][:3]
    assert _own(got, 0) == []
    assert [(r.class_ids, r.width, r.height) for r in got] == [(r.class_ids, r.width, r.height) for r in want]
    assert events[triton_client.EVENT_CHECKED] == len(blobs)
    assert events[triton_client.EVENT_REQUESTS] == 14


def test_a_server_that_always_answers_for_other_images_gives_engine_errors(bundle, tmp_path):
    blobs = _images(100, 8)
    engine = make_engine("triton", bundle, top_k=TOP_K, repository=str(_mixing_repo(tmp_path, 1)),
                         request_batch=4, concurrency=1)
    try:
        rows = engine.classify(blobs)
        events = dict(engine.events)
    finally:
        engine.close()
    # the first response is the model's own; from then on each is the one before (even a request's own earlier
    # try: each try has a new id)
    assert sorted(r.status for r in rows) == ["error"] * 4 + ["ok"] * 4  # one request of 4 answered, one not
    assert _own(rows, 100) == []
    assert all(r.error.startswith("engine_error: tritonserver answered 3 times for other images (")
               for r in rows if r.status == "error")
    assert events[triton_client.EVENT_MISMATCHES] == 1 + triton_client.MAX_MISMATCH_RETRIES


def test_a_repository_without_the_echo_is_refused_naming_repo_build(bundle, tmp_path):
    repo = build_repository("portable", None, str(tmp_path), top_k=TOP_K)
    config = repo / tn.MODEL_NAME / "config.pbtxt"
    text = config.read_text()
    for name in (tn.INPUT_TAG, tn.OUTPUT_ECHO):  # as repositories built before the echo were
        start = text.index(f'name: "{name}"')
        block = text.rindex("\n", 0, text.rindex("{", 0, start)) + 1
        text = text[:block] + text[text.index("}", start) + 2 :]
    config.write_text(text)
    assert tn.INPUT_TAG not in config.read_text() and tn.OUTPUT_ECHO not in config.read_text()
    with pytest.raises(ModelError, match=f"input {tn.INPUT_TAG} must be TYPE_INT64 \\[1\\], missing"):
        check_repository(str(repo))
    with pytest.raises(TritonError, match=r"lacks ECHO, TAG \(answers cannot be checked\); serve a repository "
                                          r"built by `bulk-classify repo build`"):
        make_engine("triton", bundle, top_k=TOP_K, repository=str(repo))


def test_the_run_report_counts_the_engines_server_starts_restarts_and_checked_answers(tmp_path):
    """The engine's counters ride on the actor's rows to the committed shards' stats and into the run report."""
    import psutil

    from pipeline.actor import ClassifyActor
    from pipeline.engines.registry import REGISTRY
    from pipeline.quality.report import build_run_report, format_run_report
    from pipeline.io.stats import ShardStats
    from pipeline.io.writer import write_shard

    batch = _work_batch  # the job's working rows of _images(start, n)

    actor = ClassifyActor(model=None, engine=REGISTRY["triton"], top_k=TOP_K, max_bytes=10_000_000, max_pixels=50_000_000,
                          engine_options={"request_batch": 4})
    try:
        outs = [actor(batch(0, 8))]
        victim = actor.engine.server.pid
        os.kill(victim, signal.SIGKILL)
        psutil.Process(victim).wait(10)
        outs.append(actor(batch(8, 8)))  # restarted between batches
    finally:
        actor.close()
    totals = ShardStats()
    for k, out in enumerate(outs):
        for shard in ShardStats.from_table(write_shard(out, output=str(tmp_path / "out"), storage_options={})):
            totals += shard
    assert totals.ok == 16
    events = totals.engine_events
    assert events[triton_client.EVENT_STARTS] == 1 and events[triton_client.EVENT_RESTARTS] == 1
    assert events[triton_client.EVENT_CHECKED] == 16 and events[triton_client.EVENT_REQUESTS] == 4
    assert events.get(triton_client.EVENT_MISMATCHES, 0) == 0 and triton_client.EVENT_FAILOVERS not in events
    report = build_run_report({**totals.report_fields(), "elapsed_s": 1.0})
    assert report["engine_events"] == dict(sorted(events.items()))
    assert "engine events       answers checked 16  requests 4  server restarts 1  server starts 1" in \
        format_run_report(report)


# ---- shared servers: slow is not dead -------------------------------------------------------------------------


def _pair(bundle, repo: str, **kw):
    owner = make_engine("triton", bundle, top_k=TOP_K, repository=repo, share_server=True, **kw)
    other = make_engine("triton", bundle, top_k=TOP_K, repository=repo, share_server=True, **kw)
    assert owner.server is not None and other.server is None and other.url == owner.url
    return owner, other


def _together(*jobs):
    with ThreadPoolExecutor(len(jobs)) as pool:
        return [f.result() for f in [pool.submit(engine.classify, blobs) for engine, blobs in jobs]]


def test_a_shared_server_that_stops_answering_for_a_while_is_waited_for_not_replaced(bundle, tmp_path, lease_dir,
                                                                                    monkeypatch):
    """The server is alive but answers nothing (SIGSTOP) for longer than a health check waits: the owner must not
    restart it, nor the other engine start one of its own; every row comes back when it answers again."""
    health_s = 1.0
    monkeypatch.setattr(triton_server, "HEALTH_TIMEOUT_S", health_s)
    monkeypatch.setattr(triton_client, "HEALTH_TIMEOUT_S", health_s)
    repo = str(build_repository("portable", None, str(tmp_path / "repo"), top_k=TOP_K))
    owner, other = _pair(bundle, repo, request_batch=4, concurrency=2)
    try:
        url, pid = owner.url, owner.server.pid
        blobs = _images(0, 24)
        _together((owner, blobs[:4]), (other, blobs[4:8]))
        os.kill(pid, signal.SIGSTOP)
        resume = threading.Timer(health_s * 5 + sum(triton_client.EXTERNAL_RETRY_S), os.kill, (pid, signal.SIGCONT))
        resume.start()
        try:
            started = time.monotonic()
            mine, theirs = _together((owner, blobs[8:16]), (other, blobs[16:]))
            waited = time.monotonic() - started
        finally:
            resume.cancel()
            with contextlib.suppress(ProcessLookupError):  # gone if it was restarted
                os.kill(pid, signal.SIGCONT)
        assert waited >= health_s * 5, "the server answered before it was resumed; the test did not test"
        assert [r.status for r in mine + theirs] == ["ok"] * 16, [r.error for r in mine + theirs if r.error][:3]
        assert _own(mine, 8) == [] and _own(theirs, 16) == []
        assert owner.server.pid == pid and owner.server.restarts == 0 and owner.url == other.url == url
        assert other.server is None
        assert owner.events[triton_client.EVENT_RESTARTS] == 0 and other.events[triton_client.EVENT_FAILOVERS] == 0
        assert owner.events[triton_client.EVENT_STARTS] == 1 and other.events[triton_client.EVENT_STARTS] == 0
    finally:
        other.close()
        owner.close()


def test_a_killed_shared_server_is_restarted_by_its_owner_and_the_other_follows(bundle, tmp_path, lease_dir):
    repo = str(build_repository("portable", None, str(tmp_path / "repo"), top_k=TOP_K))
    owner, other = _pair(bundle, repo, request_batch=4, concurrency=2)
    try:
        blobs = _images(0, 32)
        old = owner.url
        os.kill(owner.server.pid, signal.SIGKILL)
        mine, theirs = _together((owner, blobs[:16]), (other, blobs[16:]))
        assert [r.status for r in mine + theirs] == ["ok"] * 32, [r.error for r in mine + theirs if r.error][:3]
        assert _own(mine, 0) == [] and _own(theirs, 16) == []
        assert owner.url != old and other.url == owner.url and other.server is None  # one server, the owner's
        assert owner.events[triton_client.EVENT_RESTARTS] == 1
        assert other.events[triton_client.EVENT_FAILOVERS] == 1 and other.events[triton_client.EVENT_STARTS] == 0
    finally:
        other.close()
        owner.close()


# A client process: classifies images [start, start + n) through the shared server of REPO and prints one JSON line
# of (status, error, width, height) per row and its engine's counters. It holds the lease when it is first.
CLIENT = '''
import json, sys
sys.path[:0] = [sys.argv[1]]
from conftest import make_jpeg
from pipeline.engines.registry import make_engine
from pipeline.model.folder import load_model
repo, start, n, timeout_s, hold = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
size = lambda i: (24 + i % 97, 20 + i // 97)
engine = make_engine("triton", load_model(None), top_k=5, repository=repo, share_server=True, request_batch=2,
                     concurrency=2, request_timeout_s=timeout_s)
print(json.dumps({"ready": engine.server is not None}), flush=True)
if hold == "hold":
    sys.stdin.readline()
rows = engine.classify([make_jpeg(start + i, size=size(start + i)) for i in range(n)])
print(json.dumps({"rows": [(r.status, r.error, r.width, r.height) for r in rows], "events": engine.events}), flush=True)
engine.close()
'''


def _client(repo: str, lease: Path, start: int, n: int, timeout_s: float = 300.0, hold: bool = False):
    env = {**os.environ, "TMPDIR": str(lease.parent)}
    return subprocess.Popen([sys.executable, "-c", CLIENT, str(TESTS), repo, str(start), str(n), str(timeout_s),
                             "hold" if hold else "go"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)


def _lease_dir_for_processes(tmp_path, monkeypatch) -> Path:
    """Leases under tmp_path for this process and its children (children read TMPDIR)."""
    folder = tmp_path / sharing.LEASE_DIR_NAME
    folder.mkdir()
    monkeypatch.setattr(sharing.tempfile, "gettempdir", lambda: str(tmp_path))
    return folder


def test_an_idle_owner_restarts_its_dead_shared_server_for_the_users_waiting_on_it(bundle, tmp_path, monkeypatch):
    """The owner of a shared server with no batch in flight still restarts it when its process dies, and records
    the new server for its users: they wait for the owner's restart, and must not wait until its next batch."""
    _lease_dir_for_processes(tmp_path, monkeypatch)
    repo = str(build_repository("portable", None, str(tmp_path / "repo"), top_k=TOP_K))
    owner = make_engine("triton", bundle, top_k=TOP_K, repository=repo, share_server=True, request_batch=4)
    try:
        assert owner.server is not None
        dead = owner.server.pid
        os.kill(dead, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (owner.events[triton_client.EVENT_RESTARTS] == 0
                                               or not owner.server.is_ready()):
            time.sleep(0.2)
        assert owner.events[triton_client.EVENT_RESTARTS] == 1 and owner.events[triton_client.EVENT_REQUESTS] == 0
        record = owner._lease.read()
        assert record is not None and record["pid"] == owner.server.pid != dead
        assert record["url"] == owner.url
        rows = owner.classify(_images(0, 4))
        assert [r.status for r in rows] == ["ok"] * 4 and _own(rows, 0) == []
    finally:
        owner.close()


@pytest.mark.slow
def test_the_other_engine_starts_its_own_server_once_the_owner_process_is_gone(bundle, tmp_path, monkeypatch):
    lease = _lease_dir_for_processes(tmp_path, monkeypatch)
    repo = str(build_repository("portable", None, str(tmp_path / "repo"), top_k=TOP_K))
    owner = _client(repo, lease, 0, 4, hold=True)
    try:
        assert json.loads(owner.stdout.readline()) == {"ready": True}
        other = make_engine("triton", bundle, top_k=TOP_K, repository=repo, share_server=True, request_batch=4)
        try:
            assert other.server is None
            owner.kill()  # its server dies with it (PR_SET_PDEATHSIG)
            owner.wait(30)
            rows = other.classify(_images(0, 8))
            assert [r.status for r in rows] == ["ok"] * 8 and _own(rows, 0) == []
            assert other.server is not None
            assert other.events[triton_client.EVENT_FAILOVERS] == 1 and other.events[triton_client.EVENT_STARTS] == 1
        finally:
            other.close()
    finally:
        owner.kill()


# ---- the stress test ----------------------------------------------------------------------------------------------

# A portable model that sleeps on images starting with SLOW (they are not images: their rows are errors), so a
# client with a short timeout never gets their answer in time.
SLOW_MODEL = '''
import os, sys, time
sys.path[:0] = [p for p in os.environ.get("BULK_CLASSIFY_PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
import triton_python_backend_utils as pb_utils
from pipeline.triton.serve.portable_model import TritonPythonModel as Portable

class TritonPythonModel(Portable):
    def execute(self, requests):
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            if any(bytes(row[:4]) == b"SLOW" for row in images):
                time.sleep(%(sleep_s)s)
        return super().execute(requests)
'''
SLOW_S = 2.0
CLIENT_TIMEOUT_S = 1.0


def test_stress_every_answer_checked_under_many_clients_timeouts_and_server_kills(bundle, tmp_path, monkeypatch):
    """An owner engine (threads), two client processes sharing its server and a client with a short timeout, while
    the server is killed twice mid-request: every row is its own image's answer or an engine_error, never another
    image's; no answer mismatches; the kills are counted as restarts and the processes follow them."""
    lease = _lease_dir_for_processes(tmp_path, monkeypatch)
    repo = build_repository("portable", None, str(tmp_path / "repo"), top_k=TOP_K, instances=2)
    (repo / tn.MODEL_NAME / "1" / "model.py").write_text(SLOW_MODEL % {"sleep_s": SLOW_S})
    repo = str(repo)
    owner = make_engine("triton", bundle, top_k=TOP_K, repository=repo, share_server=True, request_batch=3,
                        concurrency=4)
    clients = []
    try:
        assert owner.server is not None
        clients = [_client(repo, lease, 1000 + 100 * k, 48, hold=True) for k in range(2)]
        assert [json.loads(c.stdout.readline()) for c in clients] == [{"ready": False}] * 2  # they share ours
        timed = make_engine("triton", bundle, top_k=TOP_K, repository=repo, share_server=True, request_batch=1,
                            concurrency=2, request_timeout_s=CLIENT_TIMEOUT_S)
        slow = [b"SLOW" + bytes(64)]
        kills = []

        def killer():
            for delay in (0.3, 1.0):  # after the server (restarted) is ready again
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and (owner.server.pid in (None, *kills)
                                                       or not owner.server.is_ready()):
                    time.sleep(0.1)
                time.sleep(delay)
                kills.append(owner.server.pid)
                os.kill(kills[-1], signal.SIGKILL)

        for c in clients:
            c.stdin.write("go\n")
            c.stdin.flush()
        kill_thread = threading.Thread(target=killer)
        kill_thread.start()
        try:
            parts = [(owner, _images(k * 100, 30)) for k in range(3)] + [(timed, slow + _images(500, 6))]
            results = _together(*parts)
        finally:
            kill_thread.join()
        # more work after the second kill, so every client surely meets a restarted server
        results.append(owner.classify(_images(600, 12)))
        outputs = [json.loads(c.communicate(timeout=300)[0].splitlines()[-1]) for c in clients]
        events = [dict(owner.events), dict(timed.events)] + [o["events"] for o in outputs]
        timed_rows = results[3]
        timed.close()
    finally:
        for c in clients:
            c.kill()
        owner.close()

    checked = sum(e[triton_client.EVENT_CHECKED] for e in events)
    requests = sum(e[triton_client.EVENT_REQUESTS] for e in events)
    restarts = sum(e[triton_client.EVENT_RESTARTS] for e in events)
    print(f"stress: {requests} requests, {restarts} restarts, {checked} answers checked, "
          f"{sum(e[triton_client.EVENT_MISMATCHES] for e in events)} mismatches, "
          f"{sum(e[triton_client.EVENT_TIMEOUTS] for e in events)} timeouts, "
          f"{sum(e[triton_client.EVENT_FAILOVERS] for e in events)} failovers")
    assert len(kills) == 2 and restarts >= 2 and events[0][triton_client.EVENT_RESTARTS] >= 2
    assert all(e[triton_client.EVENT_MISMATCHES] == 0 for e in events), events
    for k in range(3):
        assert [r.status for r in results[k]] == ["ok"] * 30, [r.error for r in results[k] if r.error][:3]
        assert _own(results[k], k * 100) == []
    assert _own(results[4], 600) == [] and all(r.status == "ok" for r in results[4])
    for k, out in enumerate(outputs):
        rows = out["rows"]
        assert [r[0] for r in rows] == ["ok"] * 48, [r[1] for r in rows if r[1]][:3]
        assert [(r[2], r[3]) for r in rows] == [_size(1000 + 100 * k + i) for i in range(48)]
        assert out["events"][triton_client.EVENT_STARTS] == 0  # never a server of their own
        assert out["events"][triton_client.EVENT_FAILOVERS] >= 1  # they followed the owner's restarts
    # the SLOW files never answer within the client's timeout: retried, then engine_error rows
    row = timed_rows[0]
    assert row.status == "error"
    assert row.error.startswith(f"engine_error: no answer within request_timeout_s={CLIENT_TIMEOUT_S:g} s, "), row.error
    assert events[1][triton_client.EVENT_TIMEOUTS] >= len(triton_client.EXTERNAL_RETRY_S) + 1
    # the timed client's images: their own answer, or (a loaded host) no answer in time; never another's
    assert _own(timed_rows[1:], 500) == []
    assert all(r.status == "ok" or r.error.startswith("engine_error: no answer within") for r in timed_rows[1:])
    assert checked == sum(len(r) for r in results[:3]) + 12 + 2 * 48 + sum(r.status == "ok" for r in timed_rows[1:])


def test_the_production_dali_graph_passes_each_images_tag_through(bundle):
    """The production profile's DALI model (run here on the CPU) gives each sample's TAG back as its fourth output,
    ECHO, in the order the ensemble's config declares."""
    pytest.importorskip("nvidia.dali")
    import numpy as np
    from nvidia.dali import pipeline_def

    from pipeline.triton.configs import production_configs
    from pipeline.triton.dali_pipeline import pipeline_graph

    @pipeline_def(batch_size=4, num_threads=1, device_id=None, prefetch_queue_depth=1, exec_async=False,
                  exec_pipelined=False)
    def graph():
        return pipeline_graph(bundle.spec, device="cpu", with_tag=True)

    pipe = graph()
    pipe.build()
    blobs = _images(0, 3)
    longest = max(map(len, blobs))
    tags = tn.tags(99, 3)
    pipe.feed_input(tn.INPUT_IMAGE, [np.frombuffer(b.ljust(longest, b"\0"), np.uint8) for b in blobs])
    pipe.feed_input(tn.INPUT_LENGTH, [np.array([len(b)], np.int32) for b in blobs])
    pipe.feed_input(tn.INPUT_TAG, list(tags))
    _, widths, _, echo = pipe.run()
    assert [int(np.array(echo.at(i))[0]) for i in range(3)] == tags.reshape(-1).tolist()
    assert [int(np.array(widths.at(i))[0]) for i in range(3)] == [_size(i)[0] for i in range(3)]
    pre = production_configs(bundle.spec, onnx_input=bundle.input_name)[tn.PREPROCESS_MODEL]
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(pre, model_config_pb2.ModelConfig())
    assert [t.name for t in config.input] == list(tn.INPUTS)
    assert [t.name for t in config.output] == [tn.PREPROCESSED, tn.OUTPUT_WIDTH, tn.OUTPUT_HEIGHT, tn.OUTPUT_ECHO]


def test_repo_prepare_rebuilds_a_kept_repository_built_before_the_echo(tmp_path):
    """A worker's persistent repository (or a cached archive) from before TAG/ECHO would be refused by the engine:
    ``repo prepare`` rebuilds it instead of keeping it."""
    from pipeline.triton import prepare as prep
    from pipeline.triton.plans import PlanKey, write_plan_key

    key = PlanKey("9.0", "10.3.0")

    def build(profile, model, output, **kw):  # the production build, with a plan file where TensorRT would write one
        repo = build_repository(profile, model, output, artifacts=False, **kw)
        (repo / tn.CLASSIFIER_TRT_MODEL / "1").mkdir(parents=True, exist_ok=True)
        (repo / tn.CLASSIFIER_TRT_MODEL / "1" / key.filename).write_bytes(b"plan bytes")
        write_plan_key(repo / tn.CLASSIFIER_TRT_MODEL, key)
        return repo

    dest = tmp_path / "repository"
    first = prep.prepare(str(dest), None, key=key, build=build)
    assert first["action"] == "built" and prep.prepare(str(dest), None, key=key, build=build)["action"] == "kept"
    config = dest / tn.MODEL_NAME / "config.pbtxt"
    config.write_text(config.read_text().replace(f'name: "{tn.INPUT_TAG}"', 'name: "OLD_TAG"'))
    again = prep.prepare(str(dest), None, key=key, build=build)
    assert again["action"] == "built" and f'name: "{tn.INPUT_TAG}"' in config.read_text()


@pytest.mark.slow
def test_an_owner_that_is_done_keeps_its_server_until_the_other_users_leave(bundle, tmp_path, monkeypatch):
    """The end of a job: Ray Data releases the idle owner while another actor still has calls. The owner's close()
    waits for that user, so it finishes on the same server: no failover, no second server."""
    import threading

    lease = _lease_dir_for_processes(tmp_path, monkeypatch)
    repo = str(build_repository("portable", None, str(tmp_path / "repo"), top_k=TOP_K))
    owner = make_engine("triton", bundle, top_k=TOP_K, repository=repo, share_server=True, request_batch=4)
    other = _client(repo, lease, 0, 6, hold=True)
    try:
        assert owner.server is not None and json.loads(other.stdout.readline()) == {"ready": False}
        closed = threading.Event()
        closing = threading.Thread(target=lambda: (owner.close(), closed.set()), daemon=True)
        closing.start()
        time.sleep(2 * sharing.POLL_S)
        assert not closed.is_set()  # the other engine still uses the server
        other.stdin.write("go\n")
        other.stdin.flush()
        answer = json.loads(other.stdout.readline())
        assert [row[0] for row in answer["rows"]] == ["ok"] * 6
        assert answer["events"][triton_client.EVENT_FAILOVERS] == 0 and answer["events"][triton_client.EVENT_STARTS] == 0
        other.wait(60)
        assert closed.wait(30)  # ...and once it has left, the owner stops the server
        assert owner.server is None and not list(owner._lease._users.glob("*"))
    finally:
        other.kill()
        owner.close()


# An owner as a Ray actor ends: its engine is closed by an atexit handler, after interpreter shutdown has joined
# the executor threads.
EXITING_OWNER = '''
import atexit, json, sys
sys.path[:0] = [sys.argv[1]]
from pipeline.engines.registry import make_engine
from pipeline.model.folder import load_model
engine = make_engine("triton", load_model(None), top_k=5, repository=sys.argv[2], share_server=True, request_batch=2)
atexit.register(engine.close)
print(json.dumps({"ready": engine.server is not None}), flush=True)
sys.stdin.readline()
'''


@pytest.mark.slow
def test_an_owner_process_that_exits_serves_its_other_users_until_they_leave(bundle, tmp_path, monkeypatch):
    lease = _lease_dir_for_processes(tmp_path, monkeypatch)
    repo = str(build_repository("portable", None, str(tmp_path / "repo"), top_k=TOP_K))
    owner = subprocess.Popen([sys.executable, "-c", EXITING_OWNER, str(TESTS), repo], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(lease.parent)})
    try:
        assert json.loads(owner.stdout.readline()) == {"ready": True}
        other = make_engine("triton", bundle, top_k=TOP_K, repository=repo, share_server=True, request_batch=4)
        try:
            owner.stdin.write("\n")
            owner.stdin.flush()  # the owner's interpreter exits and its atexit handler closes its engine
            time.sleep(3 * sharing.POLL_S)
            assert owner.poll() is None  # ...which keeps the server while this engine uses it
            rows = other.classify(_images(0, 8))
            assert [r.status for r in rows] == ["ok"] * 8 and _own(rows, 0) == []
            assert other.events[triton_client.EVENT_FAILOVERS] == 0 and other.server is None
        finally:
            other.close()
        assert owner.wait(60) == 0  # the last user left: the owner stopped its server and exited
    finally:
        owner.kill()



def _work_batch(start: int, n: int):
    import pyarrow as pa

    from pipeline.schema import DATA, WORK_SCHEMA

    rows = [{"uri": f"file:///{start + i}.jpg", DATA: b} for i, b in enumerate(_images(start, n))]
    columns = {f.name: [r.get(f.name) for r in rows] for f in WORK_SCHEMA}
    columns["carried"] = [False] * n
    return pa.table(columns, schema=WORK_SCHEMA)


def test_a_shared_server_outlives_its_owners_ray_actor_for_the_other_users(ray_local, tmp_path, monkeypatch):
    """The end of a job on a GPU: Ray Data drops the handle of the first idle actor, often the one whose process
    started the shared server, and Ray ends that worker (by default with its child processes, before its atexit
    handlers run) while another actor of the GPU still has calls. With the classify actors' options the job uses,
    the other actor finishes on the same server: no failover, no second server."""
    import psutil
    import ray

    from pipeline.actor import ClassifyActor
    from pipeline.engines.registry import engine_spec
    from pipeline.job.stages import classify_actor_options
    from pipeline.schema import ENGINE_EVENTS
    from pipeline.node import pid_alive

    repo = str(build_repository("portable", None, str(tmp_path / "repo"), top_k=TOP_K))
    for key in engine_spec("triton").actor_env:  # this session's Ray was started without it: the options carry it
        monkeypatch.delenv(key, raising=False)
    # the options of the job's GPU actors (this test shares one server on the CPU, as a GPU's actors do)
    remote = ray.remote(ClassifyActor).options(num_cpus=0, **classify_actor_options(engine_spec("triton"), on_gpu=True,
                                                                                      local=True))
    kwargs = dict(model=None, engine=engine_spec("triton"), top_k=TOP_K, max_bytes=10_000_000, max_pixels=50_000_000,
                  engine_options={"repository": repo, "share_server": True, "request_batch": 4})

    folder = sharing.ServerLease("probe").folder  # the workers' temp folder is this process's
    before = set(folder.glob("*.json"))
    owner = remote.remote(**kwargs)
    first = ray.get(owner.__call__.remote(_work_batch(0, 4)))
    other = remote.remote(**kwargs)
    ray.get(other.__call__.remote(_work_batch(4, 4)))
    (record_file,) = set(folder.glob("*.json")) - before
    lease = sharing.ServerLease(record_file.stem)
    record = lease.read()
    assert record is not None
    owner_pid, server = record["owner"], psutil.Process(record["pid"])
    del owner  # as Ray Data releases an idle actor: its worker exits
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and lease._record_text().get("closing") is not True:
        time.sleep(0.2)
    time.sleep(1.0)  # Ray's exit of the owner's worker has run by now
    assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
    out = ray.get(other.__call__.remote(_work_batch(8, 8)))
    assert out.column("status").to_pylist() == ["ok"] * 8
    events = [json.loads(e) for e in out.column(ENGINE_EVENTS).to_pylist() if e]
    assert not any(e.get(triton_client.EVENT_FAILOVERS) or e.get(triton_client.EVENT_STARTS) for e in events)
    assert first.column("status").to_pylist() == ["ok"] * 4
    del other  # the last user leaves: the owner stops the server and its worker exits
    server.wait(60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (lease._record_text() is not None or pid_alive(owner_pid)):
        time.sleep(0.2)
    assert lease._record_text() is None and not pid_alive(owner_pid)
