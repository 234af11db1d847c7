"""The gpu engine: its CPU logic (JPEG header triage, the Triton profile) always; the classifier
on the CPU (DALI's CPU backend, a torch CPU network) where torch and DALI are installed; the real thing on a GPU
is tests/gpu/test_gpu_engine_on_gpu.py."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest
from PIL import Image

from pipeline.triton import contract as tn
from pipeline.model.default_model import DEFAULT_SPEC
from pipeline.gpu.classifier import ClassifierOptions, GpuClassifier
from pipeline.engines.gpu import GpuEngine
from pipeline.gpu.jpeg import parse_jpeg_header
from pipeline.triton.configs import GpuModelOptions, gpu_config
from pipeline.model.folder import SPEC_FILE
from pipeline.triton.repository import SHIM_FILE, build_gpu_repository
from pipeline.errors import ConfigError, EngineError, ImageError
from pipeline.model.imaging import PreprocessSpec, load_and_preprocess
from pipeline.triton.checks import check_repository
from support.oddities import photo_set
from support.paths import BENCHMARKS, PHOTOS, REPO



def _jpeg(img: Image.Image, **save) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **save)
    return buf.getvalue()


def _photo(name: str = "chelsea") -> Image.Image:
    return Image.open(PHOTOS / f"{name}.jpg").convert("RGB")


# ---- JPEG header triage -----------------------------------------------------------------------------------


def test_header_reads_size_and_process_without_decoding():
    img = _photo()
    info = parse_jpeg_header(_jpeg(img, quality=90))
    assert (info.width, info.height, info.components, info.precision) == (img.width, img.height, 3, 8)
    assert info.process == "baseline" and info.orientation == 1 and info.complete and info.gpu_decodable
    prog = parse_jpeg_header(_jpeg(img, progressive=True))
    assert prog.process == "progressive" and prog.gpu_decodable
    gray = parse_jpeg_header(_jpeg(img.convert("L")))
    assert gray.components == 1 and gray.gpu_decodable


@pytest.mark.parametrize("orientation", range(1, 9))
def test_header_reads_exif_orientation_and_upright_size(orientation):
    img = _photo()
    exif = Image.Exif()
    exif[0x0112] = orientation
    info = parse_jpeg_header(_jpeg(img, exif=exif.tobytes()))
    assert info.orientation == orientation
    upright = Image.open(io.BytesIO(_jpeg(img, exif=exif.tobytes())))
    from PIL import ImageOps

    assert info.upright_size == ImageOps.exif_transpose(upright).size


def test_header_routes_what_nvjpeg_cannot_take_to_pillow():
    img = _photo()
    cmyk = parse_jpeg_header(_jpeg(img.convert("CMYK")))
    assert cmyk.components == 4 and not cmyk.gpu_decodable
    data = _jpeg(img)
    assert not parse_jpeg_header(data[:-2]).gpu_decodable  # no EOI: Pillow gives the authoritative verdict
    assert not parse_jpeg_header(data + b"trailing").complete


def test_header_rejects_non_jpeg_and_cut_headers():
    assert parse_jpeg_header(b"\x89PNG\r\n\x1a\n....") is None
    assert parse_jpeg_header(b"") is None
    with pytest.raises(ImageError, match="^decode_error: truncated JPEG"):
        parse_jpeg_header(_jpeg(_photo())[:60])
    with pytest.raises(ImageError, match="^decode_error: corrupt JPEG header"):
        parse_jpeg_header(b"\xff\xd8\x00\x00\x00\x00")


def test_without_dali_the_classifier_names_the_extra_to_install(monkeypatch):
    monkeypatch.setattr("pipeline.gpu.classifier.dali_available", lambda: False)
    with pytest.raises(EngineError, match=r"^the gpu engine decodes and resizes with DALI, which is not installed "
                                          r"here: pip install 'bulk-classify\[dali\]' \(nvidia-dali-cuda130; "
                                          r"the gpu extra includes it\)$"):
        GpuClassifier(None, DEFAULT_SPEC)


# ---- the Triton profile -----------------------------------------------------------------------------------


def test_gpu_config_is_the_contract_with_a_ragged_image_input():
    text = gpu_config(GpuModelOptions(top_k=3, instances=2, batch_size=128, error_output=True))
    assert "allow_ragged_batch: true" in text and "KIND_GPU" in text and "dims: 3" in text
    assert f'name: "{tn.OUTPUT_ERROR}"' in text
    assert f'name: "{tn.OUTPUT_ERROR}"' not in gpu_config(GpuModelOptions(error_output=False))


def test_gpu_config_sets_the_backlog_per_instance():
    from pipeline.triton.configs import GPU_MAX_BACKLOG

    text = gpu_config()
    def setting(value) -> str:
        return f'key: "{tn.GPU_PARAM_MAX_BACKLOG}"\n  value {{\n    string_value: "{value}"'

    assert setting(GPU_MAX_BACKLOG) in text and setting(0) in gpu_config(GpuModelOptions(max_backlog=0))


def test_the_ensemble_shape_has_no_backlog(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_ensemble import build_ensemble_repository  # noqa: PLC0415 - the benchmarks' shape

    with pytest.raises(ConfigError, match="the gpu profile's ensemble shape has no max_backlog; drop it, or use "
                                          "shape single"):
        build_ensemble_repository(None, tmp_path / "repo", max_backlog=2)


def test_built_gpu_repository_passes_the_repository_check(tmp_path):
    out = build_gpu_repository(None, tmp_path / "repo", error_output=True)
    assert check_repository(out) == [tn.MODEL_NAME]
    version = out / tn.MODEL_NAME / "1"
    assert PreprocessSpec.from_json((version / SPEC_FILE).read_text()) == DEFAULT_SPEC
    assert "from pipeline.triton.serve.gpu_model import TritonPythonModel" in (version / SHIM_FILE).read_text()


def test_committed_gpu_profile_passes_the_repository_check():
    repo = REPO / "model_repository" / "gpu"
    assert check_repository(repo) == [tn.MODEL_NAME]


# ---- torch code on the CPU (skipped where torch is not installed) -----------------------------------------


@pytest.fixture(scope="module")
def lite0():
    pytest.importorskip("torch")
    from pipeline.model.default_model import load_checkpoint
    from pipeline.gpu.networks import efficientnet_lite0

    return efficientnet_lite0(load_checkpoint())


def test_classifier_inputs_match_the_reference_preprocessing(lite0):
    """What reaches the network: DALI's rows (JPEGs, one EXIF-rotated) and the reference's (a PNG), each in its
    caller's place, against ``pipeline.model.imaging``'s own preprocessing of the same file."""
    pytest.importorskip("nvidia.dali")
    from pipeline.gpu.classifier import Chunk, triage

    clf = GpuClassifier(lite0, DEFAULT_SPEC, ClassifierOptions(device="cpu", pipeline=False, batch_size=32))
    datas = photo_set()
    chunk = Chunk([triage(i, d, clf.limits) for i, d in enumerate(datas)])
    assert [it.info is not None for it in chunk.items] == [True] * (len(datas) - 1) + [False]  # the PNG: Pillow
    clf._prepare(chunk)
    assert chunk.ok == list(range(len(datas))) and not chunk.errors and clf.refused_batches == 0
    assert tuple(chunk.inputs.shape) == (len(datas), *DEFAULT_SPEC.input_shape)
    for row, pos in enumerate(chunk.ok):
        item = chunk.items[pos]
        ref, width, height = load_and_preprocess(item.data, DEFAULT_SPEC)
        got = chunk.inputs[row].float().numpy()
        levels = np.abs(got - ref) * np.array(DEFAULT_SPEC.std)[:, None, None]
        assert (item.width, item.height) == (width, height)
        if item.info is None:
            assert levels.max() == 0  # the reference's own array
        else:
            # DALI's CPU decode gives Pillow's pixels; its resize rounds a few values the other way (seen: at most
            # 1.2 % of them, by one level)
            assert levels.max() <= 1.0 and (levels > 0).mean() < 0.02
    clf.close()


def test_lite0_torch_module_equals_the_onnx_graph(lite0):
    torch = pytest.importorskip("torch")
    from pipeline.model.folder import load_model
    import onnxruntime as ort

    bundle = load_model(None)
    sess = ort.InferenceSession(str(bundle.onnx_path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).uniform(-1, 1, (2, 3, 224, 224)).astype(np.float32)
    ref = sess.run([bundle.output_name], {bundle.input_name: x})[0]
    with torch.no_grad():
        got = lite0(torch.from_numpy(x)).numpy()
    assert np.abs(got - ref).max() < 1e-3


def test_engine_isolates_bad_images_and_keeps_order(lite0):
    """Bad inputs among good ones, batches of 4 prepared ahead on DALI's pipeline: each bad input is its own error
    row, every good one gets the answer it gets alone."""
    pytest.importorskip("nvidia.dali")
    clf = GpuClassifier(lite0, DEFAULT_SPEC, ClassifierOptions(device="cpu", batch_size=4, prep_workers=2))
    good = photo_set()[:5]
    datas = [good[0], b"", good[1][: len(good[1]) // 2], good[2], b"not an image", good[3], good[4]]
    raw = clf.classify(datas)
    assert raw.errors[1].startswith("empty: ") and raw.errors[2].startswith("decode_error: ")
    assert raw.errors[4].startswith("unsupported: ")
    alone = clf.classify([good[0], good[1], good[2], good[3], good[4]])
    for i, j in ((0, 0), (3, 2), (5, 3), (6, 4)):
        assert raw.errors[i] == "" and raw.class_ids[i, 0] == alone.class_ids[j, 0]
        assert np.allclose(raw.scores[i], alone.scores[j], atol=1e-5)
    assert (np.diff(raw.scores[0]) <= 0).all() and 0 < raw.scores[0, 0] <= 1
    clf.close()


def test_concurrent_calls_share_one_stream_with_dali_at_depth_two(lite0):
    """The gpu engine as an actor runs it (several calls at once into one RequestStream), on DALI's CPU backend
    with two batches in flight on one pipeline: every call gets its own images' answers (those of one call alone
    at depth 1), bad inputs included."""
    import threading

    pytest.importorskip("nvidia.dali")
    from pipeline.model.folder import load_model

    bundle = load_model(None)
    good = photo_set()[:6]
    calls = [[good[0], good[1], b"not an image"], [good[2], good[3][: len(good[3]) // 2], good[4]],
             [good[5], good[0], b""], good[1:5]]
    alone = GpuEngine(bundle, top_k=3, network=lite0, device="cpu", batch_size=4, pipeline=False,
                      dali_depth=1)
    want = [[(r.status, r.error and r.error.split(":")[0], r.class_ids) for r in alone.classify(c)] for c in calls]
    alone.close()
    engine = GpuEngine(bundle, top_k=3, network=lite0, device="cpu", batch_size=4, dali_depth=2)
    got: dict = {}
    threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, engine.classify(calls[k])))
               for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    engine.close()
    for k, rows in enumerate(want):
        assert [(r.status, r.error and r.error.split(":")[0], r.class_ids) for r in got[k]] == rows, k
    assert [r.status for r in got[0]] == ["ok", "ok", "error"] and got[2][2].error.startswith("empty")


def test_gpu_profile_through_tritonserver_on_the_cpu(tmp_path):
    """The gpu profile's python model in a real tritonserver (instances on the CPU here): ragged requests share
    execute() calls, results match the in-process classifier, a bad image is isolated to its own row."""
    pytest.importorskip("torch")
    pytest.importorskip("nvidia.dali")
    import urllib.request

    from pipeline.engines.triton import TritonEngine
    from pipeline.model.folder import load_model
    from pipeline.triton.server import TritonServer

    repo = build_gpu_repository(None, tmp_path / "repo", instances=1, batch_size=8,
                                max_batch_size=64, error_output=False, queue_delay_us=20000)
    config = repo / tn.MODEL_NAME / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_GPU", "KIND_CPU"))
    bundle = load_model(None)
    good = photo_set()[:6]
    datas = good[:3] + [good[3][:2000], b"not an image"] + good[3:]
    with TritonServer(repo) as server:
        engine = TritonEngine(bundle, url=server.grpc_url, request_batch=2, concurrency=4)
        rows = engine.classify(datas)
        engine.close()
        metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert rows[3].error.startswith("decode_error: ") and rows[4].error.startswith("unsupported: ")
    ok = [r for i, r in enumerate(rows) if i not in (3, 4)]
    assert [r.status for r in ok] == ["ok"] * 6
    with GpuEngine(bundle, top_k=5, device="cpu") as local:
        expected = local.classify(good)
    assert [r.class_ids[0] for r in ok] == [r.class_ids[0] for r in expected]
    assert [(r.width, r.height) for r in ok] == [(r.width, r.height) for r in expected]
    counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith(("nv_inference_request_success{", "nv_inference_exec_count{"))}
    assert counts["nv_inference_exec_count"] < counts["nv_inference_request_success"]  # requests were merged
