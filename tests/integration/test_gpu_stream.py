"""The gpu profile's request stream (pipeline.gpu.stream) in a real tritonserver, on the CPU.

The profile's model serving the hop (tests/benchmarks/hop_model.py) runs the whole Triton side - execute() queueing requests, the stream
cutting them into batches across requests, responses sent from the stream's thread - with a classifier that does no
work and answers each image with ids derived from its own bytes. So every answer can be checked against its image:
many clients at once, ragged request sizes, bad inputs among them, a server restart in the middle.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pipeline.gpu.stream import RequestStream
from pipeline.engines.triton import TritonEngine
from pipeline.model.imaging import DecodeLimits
from pipeline.model.folder import load_model
from pipeline.triton import contract as tn
from pipeline.triton.repository import build_gpu_repository
from pipeline.triton.server import TritonServer
from support.oddities import encode, photo
from support.paths import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))
from hop_model import NullClassifier, echo_ids, serve_hop  # noqa: E402

def _repo(tmp_path, **options):
    repo = build_gpu_repository(None, tmp_path / "repo", error_output=True,
                                **{"instances": 1, **options})
    config = repo / tn.MODEL_NAME / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_GPU", "KIND_CPU"))
    return serve_hop(repo)


def _images(n: int, seed: int = 0) -> list[bytes]:
    """Distinct JPEG-looking files of ragged sizes (SOI ... EOI): the stream routes them by header, decodes none."""
    rng = random.Random(seed)
    base = encode(photo().resize((64, 48)), "JPEG")
    out = []
    for i in range(n):
        pad = rng.randrange(0, 3000)
        # a COM segment makes each file unique and of its own length, still a valid JPEG
        body = f"img{i}".encode() + bytes(rng.randrange(256) for _ in range(pad % 200)) + b"x" * pad
        body = body[:60000]
        com = b"\xff\xfe" + (len(body) + 2).to_bytes(2, "big") + body
        out.append(base[:2] + com + base[2:])
    return out


def _classify_together(url: str, bundle, parts: list, shapes: list[tuple[int, int]]) -> list:
    """Each part classified at once by its own engine of (request_batch, concurrency), as several actors do; the
    rows of each part."""
    engines = [TritonEngine(bundle, url=url, request_batch=rb, concurrency=c) for rb, c in shapes]
    try:
        with ThreadPoolExecutor(len(parts)) as pool:
            return list(pool.map(lambda k: engines[k].classify(parts[k]), range(len(parts))))
    finally:
        for engine in engines:
            engine.close()


def _check(rows, datas, bundle) -> None:
    want = echo_ids(datas, 5)
    for i, (row, data) in enumerate(zip(rows, datas)):
        assert row.status == "ok", (i, row.error)
        assert [bundle.labels.index(label) for label in row.labels] == want[i].tolist(), i


def test_every_answer_is_its_own_images_with_many_clients(tmp_path):
    bundle = load_model(None)
    datas = _images(1200)
    with TritonServer(_repo(tmp_path, batch_size=64, max_delay_ms=1.0)) as server:
        parts = [datas[k * 400 : (k + 1) * 400] for k in range(3)]
        for part, rows in zip(parts, _classify_together(server.grpc_url, bundle, parts, [(7, 8), (64, 4), (1, 16)])):
            _check(rows, part, bundle)
        metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    # requests of 1, 7 and 64 images were merged: the server saw fewer execute() calls than requests
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith(("nv_inference_request_success", "nv_inference_exec_count")) and "classifier" in line}
    assert counts["nv_inference_request_success"] >= 400 + 400 // 7 + 400 // 64


def test_bad_inputs_are_their_own_rows_in_the_stream(tmp_path):
    bundle = load_model(None)
    good = _images(40, seed=1)
    datas = good[:10] + [b"", b"not an image at all"] + good[10:] + [b"\xff\xd8\xff"]
    with TritonServer(_repo(tmp_path, batch_size=16)) as server:
        with TritonEngine(bundle, url=server.grpc_url, request_batch=8, concurrency=4) as engine:
            rows = engine.classify(datas)
    assert rows[10].status == "error" and rows[10].error.startswith("empty: ")  # the client's caps
    # not JPEGs the GPU decodes: errors raised inside the stream's batches, each on its own row
    assert rows[11].status == "error" and rows[11].error.startswith("unsupported: not a JPEG")
    assert rows[-1].status == "error"
    _check(rows[:10] + rows[12:-1], datas[:10] + datas[12:-1], bundle)


def test_a_restarted_server_answers_every_image(tmp_path):
    """The engine owns its server; killing it mid-run loses nothing: each image still gets its own answer."""
    import threading

    bundle = load_model(None)
    datas = _images(3000, seed=2)
    engine = TritonEngine(bundle, repository=str(_repo(tmp_path, batch_size=64)), request_batch=16, concurrency=8)
    try:
        killer = threading.Timer(0.5, lambda: os.kill(engine.server.pid, signal.SIGKILL))
        killer.start()
        rows = engine.classify(datas)
        killer.join()
        rows += engine.classify(datas[:100])
        restarts = engine.server.restarts
    finally:
        engine.close()
    _check(rows, datas + datas[:100], bundle)
    assert np.all([r.status == "ok" for r in rows])
    assert restarts >= 1  # the kill landed while images were in flight


def test_engines_of_one_gpu_share_one_server_and_survive_its_loss(tmp_path, monkeypatch):
    """share_server: the second engine connects to the first one's server; when the owner restarts it, or closes,
    the other takes the lease again (finds the new server, or starts and owns one) and loses no image."""
    from pipeline.triton import sharing

    monkeypatch.setattr(sharing.tempfile, "gettempdir", lambda: str(tmp_path))
    bundle = load_model(None)
    datas = _images(600, seed=3)
    repo = str(_repo(tmp_path, batch_size=64))
    owner = TritonEngine(bundle, repository=repo, request_batch=16, concurrency=4, share_server=True)
    other = TritonEngine(bundle, repository=repo, request_batch=16, concurrency=4, share_server=True)
    try:
        assert owner.server is not None and other.server is None and other.url == owner.url
        _check(owner.classify(datas[:300]) + other.classify(datas[300:]), datas, bundle)
        os.kill(owner.server.pid, signal.SIGKILL)  # the owner restarts it on its next call; the other follows
        _check(owner.classify(datas[:50]), datas[:50], bundle)
        _check(other.classify(datas), datas, bundle)
        assert other.url == owner.url and other.server is None
        owner.close()  # the owner leaves: the other starts its own server and owns the lease
        _check(other.classify(datas[:200]), datas[:200], bundle)
        assert other.server is not None
    finally:
        owner.close()
        other.close()


class _SlowNull(NullClassifier):
    """The no-work classifier, each batch held ``delay_s`` on its way out: work that takes time, as a GPU's does."""

    def __init__(self, delay_s: float, **kw):
        super().__init__(**kw)
        self.delay_s = delay_s

    def run_stream(self, source, sink) -> None:
        def slow_sink(*args):
            time.sleep(self.delay_s)
            sink(*args)

        super().run_stream(source, slow_sink)


def test_a_full_backlog_makes_submit_wait_until_work_is_done():
    """max_backlog: with two batches' worth of images in the stream, the next submit waits for a response first
    (so that Triton gives the next requests to another model instance); every answer is still its own image's."""
    answered: dict = {}
    order: list = []

    def respond(sender, raw, n):
        order.append(("answered", sender))
        answered[sender] = raw

    stream = RequestStream(_SlowNull(0.1, batch_size=8, top_k=5), respond, top_k=5, max_backlog=2)
    datas = _images(40, seed=4)
    try:
        stream.submit("a", datas[:16], DecodeLimits())  # 16 images: the whole backlog, let in at once
        order.append(("submitted", "a"))
        waiter = threading.Thread(target=lambda: (stream.submit("b", datas[16:20], DecodeLimits()),
                                                  order.append(("submitted", "b"))))
        waiter.start()
        waiter.join(10)
        stream.submit("c", datas[20:40], DecodeLimits())  # more than the backlog holds, let in: it is not full
        deadline = time.monotonic() + 10
        while len(answered) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stream.close()
    assert order.index(("answered", "a")) < order.index(("submitted", "b"))
    assert stream.waits == 1 and stream.wait_s > 0.05  # b waited for a; c found 4 of 16 images in the stream
    for sender, part in (("a", datas[:16]), ("b", datas[16:20]), ("c", datas[20:40])):
        assert answered[sender].class_ids.tolist() == echo_ids(part, 5).tolist(), sender
    assert "3 requests, 40 images" in stream.stats() and "max_backlog 16 images" in stream.stats()


def test_instances_with_a_backlog_share_the_requests(tmp_path):
    """Two model instances, each taking one batch before its execute() waits (max_backlog 1): the server hands the
    requests to both, every answer is its own image's, and each instance's share is in the log at shutdown."""
    bundle = load_model(None)
    datas = _images(960, seed=5)
    server = TritonServer(_repo(tmp_path, instances=2, batch_size=16, max_backlog=1))
    with server:
        parts = [datas[k * 320 : (k + 1) * 320] for k in range(3)]
        for part, rows in zip(parts, _classify_together(server.grpc_url, bundle, parts, [(16, 8)] * 3)):
            _check(rows, part, bundle)
    lines = [line for line in server.stopped_log.splitlines() if "gpu stream of instance" in line]
    assert len(lines) == 2, server.stopped_log[-2000:]
    shares = [int(re.search(r"requests, (\d+) images", line).group(1)) for line in lines]
    assert sum(shares) == len(datas) and min(shares) > 0, lines
    assert any(int(re.search(r"waited (\d+) times", line).group(1)) > 0 for line in lines), lines


def test_each_answer_carries_its_own_images_tag():
    """The TAG of each image travels on its item through the stream's batches and comes back beside its answer, for
    classified images and for those triage refused alike."""
    answered: dict = {}
    stream = RequestStream(NullClassifier(batch_size=8, top_k=5), lambda s, raw, n: answered.setdefault(s, raw),
                           top_k=5)
    datas = _images(30, seed=6)
    parts = {"a": datas[:13] + [b""], "b": datas[13:]}
    tags = {name: tn.tags(7 + k, len(part)).reshape(-1) for k, (name, part) in enumerate(parts.items())}
    try:
        for name, part in parts.items():
            stream.submit(name, part, DecodeLimits(), tags[name])
        deadline = time.monotonic() + 10
        while len(answered) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stream.close()
    for name in parts:
        assert answered[name].echo.tolist() == tags[name].tolist(), name
    assert answered["a"].errors[-1].startswith("empty: ")
