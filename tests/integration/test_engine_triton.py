"""--engine triton against --engine onnx through a real tritonserver (portable profile): same results, one row per
input, odd inputs included; a bad input isolated by splitting; a killed server restarted mid-run; clean close."""

from __future__ import annotations

import os
import sys
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from support.oddities import oddities

from pipeline.triton import contract as tn
from pipeline.engines.registry import make_engine
from pipeline.triton.wire import plan_requests
from pipeline.errors import ConfigError
from pipeline.model.folder import MODEL_FILE, SPEC_FILE, load_model
from pipeline.model.imaging import DecodeLimits
from pipeline.triton.configs import portable_config
from pipeline.triton.repository import CONFIG_FILE, SHIM_FILE, add_topk_head
from pipeline.triton.server import SHM_DIR, TritonServer
from support.paths import BENCHMARKS, PHOTOS

# Same ONNX graph and the same reference preprocessing on both sides; only batch composition differs.
SCORE_TOLERANCE = 1e-4
TOP_K = 5


@pytest.fixture(scope="module")
def bundle():
    return load_model(None)


@pytest.fixture(scope="module")
def onnx_engine(bundle):
    engine = make_engine("onnx", bundle, top_k=TOP_K, limits=DecodeLimits())
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def triton_engine(bundle):
    engine = make_engine("triton", bundle, top_k=TOP_K, limits=DecodeLimits(), request_batch=8, concurrency=2)
    yield engine
    engine.close()


def _photos() -> dict[str, bytes]:
    return {p.stem: p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))}


def _kind(error: str | None) -> str | None:
    return error.split(":", 1)[0] if error else None


def test_triton_matches_onnx_on_photos_and_oddities(triton_engine, onnx_engine):
    inputs = _photos()
    expected = {}
    for name, (data, status, kind) in oddities().items():
        inputs[f"odd_{name}"] = data
        expected[f"odd_{name}"] = (status, kind)
    names = list(inputs)
    blobs = [inputs[n] for n in names]
    got = triton_engine.classify(blobs)
    want = onnx_engine.classify(blobs)
    assert len(got) == len(blobs) == len(want)
    for name, g, w in zip(names, got, want):
        assert (g.status, _kind(g.error)) == (w.status, _kind(w.error)), name
        if name in expected:
            assert (g.status, _kind(g.error)) == expected[name], name
        assert g.error == w.error, name  # the same reference code decodes on both sides: same text
        assert (g.width, g.height) == (w.width, w.height), name
        if g.status == "ok":
            assert g.class_ids[0] == w.class_ids[0], f"{name}: top-1 {g.labels[0]} vs {w.labels[0]}"
            assert len(g.class_ids) == len(g.scores) == len(g.labels) == TOP_K
            assert max(abs(a - b) for a, b in zip(g.scores, w.scores)) < SCORE_TOLERANCE, name
            assert g.labels[0] == w.labels[0]
            assert g.scores == sorted(g.scores, reverse=True)


def test_one_result_per_input_in_order_across_many_requests(triton_engine):
    photos = list(_photos().values())
    blobs = [photos[i % len(photos)] for i in range(37)] + [b"", b"x" * 10]
    results = triton_engine.classify(blobs)
    assert len(results) == len(blobs)
    first = {}
    for blob, result in zip(blobs, results):
        if blob in first:  # the same file gives the same answer wherever it sits in the batch
            assert result.class_ids == first[blob].class_ids
        first.setdefault(blob, result)
    assert [r.status for r in results[-2:]] == ["error", "error"]
    assert triton_engine.classify([]) == []


def test_caps_are_enforced_before_sending_with_the_reference_text(bundle, triton_engine, onnx_engine):
    photo = _photos()["chelsea"]
    small = DecodeLimits(max_bytes=len(photo) - 1, max_pixels=10_000)
    original = triton_engine.limits
    triton_engine.limits = small
    try:
        got = triton_engine.classify([photo])
    finally:
        triton_engine.limits = original
    onnx = make_engine("onnx", bundle, top_k=TOP_K, limits=small)
    try:
        want = onnx.classify([photo])
    finally:
        onnx.close()
    assert got[0].status == "error" and got[0].error.startswith("too_large: ")
    assert got[0].error == want[0].error


def test_top_k_above_the_repository_k_is_refused(bundle, triton_engine):
    with pytest.raises(ConfigError, match="lower top_k or rebuild the repository"):
        make_engine("triton", bundle, top_k=triton_engine.repository_k + 1, url=triton_engine.url)


def test_external_server_by_url_is_used_and_left_running(bundle, triton_engine):
    engine = make_engine("triton", bundle, top_k=2, url=triton_engine.url)
    try:
        results = engine.classify([_photos()["coffee"]])
    finally:
        engine.close()
    assert results[0].status == "ok" and len(results[0].scores) == 2
    assert triton_engine.server.is_ready()


def test_plan_requests_groups_by_size_and_caps_padding():
    sizes = [10, 1000, 20, 30, 5000, 40]
    groups = plan_requests(sizes, request_batch=2, max_request_bytes=6000)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    assert all(len(g) <= 2 and len(g) * max(sizes[i] for i in g) <= 6000 or len(g) == 1 for g in groups)
    assert groups[0] == [0, 2]  # the two smallest travel together


def test_encoded_request_is_the_protobuf_message_byte_for_byte_in_meaning():
    from tritonclient.grpc import service_pb2

    sys.path.insert(0, str(BENCHMARKS))
    from bench_hop import build_request  # noqa: PLC0415 - the message path the benchmarks compare against

    from pipeline.triton.wire import encode_request
    from pipeline.model.imaging import DecodeLimits

    limits = DecodeLimits(max_bytes=123_456_789, max_pixels=7)
    for blobs in ([b"x"], [b"ab", b"c" * 300, b"\0" * 17], [bytes([i % 256]) * (40_000 + i) for i in range(5)]):
        tags = tn.tags(12345, len(blobs))
        message = build_request("m", blobs, ["SCORES", "ERROR"], limits, tags)
        parsed = service_pb2.ModelInferRequest.FromString(encode_request("m", blobs, ["SCORES", "ERROR"], limits,
                                                                         tags))
        assert parsed == message
        longest = max(map(len, blobs))
        assert parsed.raw_input_contents[0] == b"".join(b.ljust(longest, b"\0") for b in blobs)
        assert [i.name for i in parsed.inputs] == [tn.INPUT_IMAGE, tn.INPUT_LENGTH, tn.INPUT_TAG]
        assert list(np.frombuffer(parsed.raw_input_contents[2], np.int64)) == [(12345 << 24) + i
                                                                              for i in range(len(blobs))]


# A DALI-like model: it fails the whole request when one input is bad (as one corrupt JPEG fails a DALI batch)
# and has no ERROR output, so the engine must isolate the bad input by splitting.
WHOLE_BATCH_FAILING_MODEL = '''
import os, sys
sys.path[:0] = [p for p in os.environ.get("BULK_CLASSIFY_PYTHONPATH", "").split(os.pathsep) if p]
import numpy as np
import triton_python_backend_utils as pb_utils
from pipeline.triton.serve.portable_model import Classifier

class TritonPythonModel:
    def initialize(self, args):
        from pathlib import Path
        self.classifier = Classifier(Path(args["model_repository"]) / args["model_version"], intra_op_threads=1)

    def execute(self, requests):
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "LENGTH").as_numpy()
            tags = pb_utils.get_input_tensor_by_name(request, "TAG").as_numpy()
            out = self.classifier.classify(images, lengths, tags=tags)
            bad = [e for e in out.pop("ERROR").reshape(-1) if e]
            if bad:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError("Failed to decode sample: " + bad[0].decode())))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in out.items()]))
        return responses
'''


def test_a_request_failing_on_one_input_is_split_so_only_that_input_fails(bundle, tmp_path):
    folder = tmp_path / tn.MODEL_NAME
    (folder / "1").mkdir(parents=True)
    config = portable_config(top_k=TOP_K, instances=1).replace('name: "ERROR"', 'name: "UNUSED_ERROR"')
    (folder / CONFIG_FILE).write_text(config)
    (folder / "1" / SHIM_FILE).write_text(WHOLE_BATCH_FAILING_MODEL)
    (folder / "1" / SPEC_FILE).write_text(bundle.spec.to_json())
    add_topk_head(bundle.onnx_path, folder / "1" / MODEL_FILE, k=TOP_K)
    photos = list(_photos().values())
    truncated = photos[0][: len(photos[0]) // 2]
    blobs = photos[:5] + [truncated] + photos[5:]
    engine = make_engine("triton", bundle, top_k=TOP_K, repository=str(tmp_path), request_batch=16)
    try:
        assert engine.has_error_output is False
        results = engine.classify(blobs)
    finally:
        engine.close()
    assert [r.status for r in results] == ["ok"] * 5 + ["error"] + ["ok"] * (len(photos) - 5)
    assert results[5].error.startswith("decode_error: server: Failed to decode sample")


def test_killing_the_server_mid_run_restarts_it_and_every_row_comes_back(bundle):
    photos = list(_photos().values())
    blobs = [photos[i % len(photos)] for i in range(160)]
    engine = make_engine("triton", bundle, top_k=TOP_K, request_batch=8, concurrency=2)
    try:
        reference = {blob: r.class_ids[0] for blob, r in zip(photos, engine.classify(photos))}
        victim = engine.server.pid
        killer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))
        killer.start()
        started = time.monotonic()
        results = engine.classify(blobs)
        killer.join()
        assert time.monotonic() - started > 0.5, "the run ended before the kill; make it longer"
        assert engine.server.restarts >= 1 and engine.server.pid != victim
        assert len(results) == len(blobs)
        assert all(r.status == "ok" for r in results), [r.error for r in results if r.status != "ok"][:3]
        assert [r.class_ids[0] for r in results] == [reference[b] for b in blobs]
        # Between batches: a server killed while idle is restarted before the next batch is sent.
        os.kill(engine.server.pid, signal.SIGKILL)
        psutil.Process(engine.server.pid).wait(10)
        assert engine.classify(photos[:2])[0].status == "ok"
        assert engine.server.restarts >= 2
        # close() after restarts: no server, stub, shared memory or temporary folder left behind; the repository
        # is the profile's cached one, kept for the next engine.
        server: TritonServer = engine.server
        tree = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
        assert len(tree) >= 2 and list(SHM_DIR.glob(server.shm_prefix + "*"))
        prefix, repository = server.shm_prefix, server.repository
    finally:
        engine.close()
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive
    assert not list(SHM_DIR.glob(prefix + "*"))
    assert repository.is_dir() and repository.parent.name == "repositories"


def test_unknown_option_is_a_config_error_naming_the_valid_ones(bundle):
    with pytest.raises(ConfigError, match=r"engine 'triton' has no option max_batch; its options are profile, repository"):
        make_engine("triton", bundle, max_batch=3)


def _cli_run(source: Path, output: Path, engine: str) -> dict[str, dict]:
    import subprocess
    import sys

    import pyarrow.parquet as pq

    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(source), "--output", str(output), "--engine", engine,
           "--num-actors", "1", "-q"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    table = pq.read_table(sorted(output.rglob("part-*.parquet")))  # shards sit in group folders
    return {row["uri"].rsplit("/", 1)[-1]: row for row in table.to_pylist()}


@pytest.mark.slow
def test_cli_run_with_triton_matches_onnx(tmp_path, onnx_engine):
    """`bulk-classify run --engine triton` over a folder gives the rows --engine onnx gives for the same files."""
    source = tmp_path / "images"
    source.mkdir()
    for name, data in _photos().items():
        (source / f"{name}.jpg").write_bytes(data)
    odd = oddities()
    for name in ("empty", "plain_text", "truncated_jpeg", "exif_rotated_jpeg", "rgba_png", "gif"):
        suffix = {"rgba_png": "png", "gif": "png"}.get(name, "jpg")  # listed by extension; content decides
        (source / f"odd_{name}.{suffix}").write_bytes(odd[name][0])
    triton = _cli_run(source, tmp_path / "out_triton", "triton")
    # The onnx side in-process (same engine the CLI's onnx actor runs) saves a second Ray job.
    files = sorted(p.name for p in source.iterdir())
    want = dict(zip(files, onnx_engine.classify([(source / f).read_bytes() for f in files])))
    assert sorted(triton) == files
    for name, t in triton.items():
        o = want[name]
        assert t["engine"] == "triton"
        assert (t["status"], t["error"], t["width"], t["height"]) == (o.status, o.error, o.width, o.height)
        if t["status"] == "ok":
            assert t["class_ids"][0] == o.class_ids[0], name
            assert max(abs(a - b) for a, b in zip(t["scores"], o.scores)) < SCORE_TOLERANCE, name
    assert triton["odd_truncated_jpeg.jpg"]["error"].startswith("decode_error: ")
    assert triton["odd_empty.jpg"]["status"] == "error"


def test_portable_profile_without_error_output_gives_the_same_rows(bundle, onnx_engine, tmp_path):
    """The numpy-2 variant (no BYTES ERROR output): bad inputs fail their request, the engine splits it, and
    each bad input's own request carries the reference's exact error text."""
    from pipeline.triton.repository import build_repository

    repo = build_repository("portable", None, str(tmp_path), error_output=False)
    odd = oddities()
    names = ["jpeg", "empty", "plain_text", "truncated_jpeg", "gif", "exif_rotated_jpeg", "random_bytes"]
    blobs = [odd[n][0] for n in names] + list(_photos().values())
    engine = make_engine("triton", bundle, top_k=TOP_K, repository=str(repo), request_batch=16)
    try:
        assert engine.has_error_output is False
        got = engine.classify(blobs)
    finally:
        engine.close()
    want = onnx_engine.classify(blobs)
    assert [(g.status, g.error) for g in got] == [(w.status, w.error) for w in want]
    assert [g.class_ids[:1] for g in got] == [w.class_ids[:1] for w in want]


# The portable model, except that an input starting with b"CRASH" kills its stub, as a segfaulting decoder would.
# Triton then keeps answering "Stub process ... is not healthy" while reporting itself ready.
CRASHING_MODEL = '''
import os, sys
sys.path[:0] = [p for p in os.environ.get("BULK_CLASSIFY_PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
import triton_python_backend_utils as pb_utils
from pipeline.triton.serve.portable_model import TritonPythonModel as Portable

class TritonPythonModel(Portable):
    def execute(self, requests):
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            if any(bytes(row[:5]) == b"CRASH" for row in images):
                os._exit(1)
        return super().execute(requests)
'''


@pytest.mark.slow
def test_an_input_that_crashes_the_backend_costs_one_row_and_the_run_goes_on(bundle, tmp_path):
    from pipeline.triton.repository import build_repository

    repo = build_repository("portable", None, str(tmp_path))
    (repo / tn.MODEL_NAME / "1" / "model.py").write_text(CRASHING_MODEL)
    photos = list(_photos().values())
    blobs = photos + [b"CRASH" + bytes(100)] + photos
    engine = make_engine("triton", bundle, top_k=TOP_K, repository=str(repo), request_batch=8, concurrency=2)
    try:
        results = engine.classify(blobs)
        assert [r.status for r in results] == ["ok"] * len(photos) + ["error"] + ["ok"] * len(photos)
        assert results[len(photos)].error.startswith("engine_error: tritonserver failed 2 times serving this input")
        assert engine.server.restarts >= 2
        assert [r.status for r in engine.classify(photos[:3])] == ["ok"] * 3  # and the server serves again
    finally:
        engine.close()


def test_a_refused_input_never_counts_as_a_server_down(triton_engine, monkeypatch):
    """INVALID_ARG means the server read the request: no health check (which a loaded host may time out) and so no
    restart of a healthy server."""
    from tritonclient.utils import InferenceServerException

    def no_health_check(*_args, **_kwargs):
        raise AssertionError("a refused input must not trigger a health check")

    monkeypatch.setattr(triton_engine.server, "is_ready", no_health_check)
    refused = InferenceServerException("decode_error: cannot identify image file", status="StatusCode.INVALID_ARGUMENT")
    assert triton_engine._server_down(refused) is False
    monkeypatch.undo()
    gone = InferenceServerException("connection refused", status="StatusCode.UNAVAILABLE")
    assert triton_engine._server_down(gone) is True
