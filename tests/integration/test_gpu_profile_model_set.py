"""A model set and embeddings through the triton engine's gpu profile, on the CPU: its python model (DALI's CPU backend,
torch on the CPU) in a real tritonserver (KIND_CPU) serves the built-in model and a user's folder declaring an embedding
as one model; each model answers as the onnx engine does for it alone on real photos (top-1 where decided, the top-1
probability within the GPU paths' bound, the embedding's cosine), an undecodable input is one error row for every
model; the repository is cached by the set; a repository without the set's outputs is refused in the driver; the
driver's node server is the set's. The GPU tier's counterpart: tests/gpu/test_gpu_profile_model_set_on_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.model.folder import MODEL_FILE, SPEC_FILE, load_model
from pipeline.schema import STATUS_ERROR, STATUS_OK
from pipeline.triton import contract as tn
from support import user_models
from support.oddities import photo_set
from support.paths import PARITY, PHOTOS

torch = pytest.importorskip("torch")
pytest.importorskip("nvidia.dali", reason="the gpu profile needs nvidia-dali-cuda130 (the test extra)")
pytest.importorskip("onnx2torch")
pytest.importorskip("onnxslim")
pytest.importorskip("tritonclient")

TOP_K = 7  # more than the user's model's CLASSES: its top-k is capped at its classes
# DALI's resize is not Pillow's to the last bit: the top-1 probability within this (test_gpu_user_model.py's bound) ...
SCORE_BOUND = 0.05
# ... and each embedding's cosine to the onnx engine's at least this (test_gpu_embedding.py's).
COSINE_BOUND = 0.999
DECIDED = 0.02  # a top-1 margin over the second class past which the top-1 must agree


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = user_models.model_folder(tmp_path_factory.mktemp("user") / "embed", user_models.TinyNet(scale=20.0),
                                      embedding=True)
    return load_model(None), load_model(folder)


@pytest.fixture(scope="module")
def images():
    photos = photo_set() + [p.read_bytes() for p in sorted((PARITY / "inputs").glob("*.jpg"))[:8]]
    return photos + [b"not an image at all", photos[0][: len(photos[0]) // 3]]


def serve_on_cpu(repo):
    """``repo``'s gpu model as KIND_CPU instances (DALI's CPU backend, torch on the CPU), in a tritonserver."""
    from pipeline.triton.server import TritonServer

    config = repo / tn.MODEL_NAME / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_GPU", "KIND_CPU"))
    return TritonServer(repo)


def _onnx(bundle, images, top_k):
    from pipeline.engines.onnx import OnnxEngine

    with OnnxEngine(bundle, top_k=top_k) as engine:
        return engine.classify(images)


def test_the_served_set_answers_each_model_as_the_onnx_engine_does_alone(models, images, tmp_path):
    from pipeline.engines.triton import TritonEngine
    from pipeline.triton.repository import build_gpu_repository

    builtin, user = models
    repo = build_gpu_repository(None, tmp_path / "repo", more=[str(user.onnx_path.parent)], instances=1,
                                batch_size=4, max_batch_size=16, top_k=TOP_K)
    with serve_on_cpu(repo) as server:
        engine = TritonEngine(builtin, url=server.grpc_url, top_k=TOP_K, more=(user,), request_batch=4, concurrency=2)
        try:
            got = engine.classify(images)
        finally:
            engine.close()
    first_ort, second_ort = _onnx(builtin, images, TOP_K), _onnx(user, images, user_models.CLASSES)
    assert len(got) == len(images)
    cosines, decided, worst = [], 0, 0.0
    for i, row in enumerate(got):
        assert row.status == first_ort[i].status, (i, row.error, first_ort[i].error)
        if row.status == STATUS_ERROR:  # not decoded: every model's error, in the row itself
            assert row.error.split(":")[0] == first_ort[i].error.split(":")[0] and row.more == [], i
            continue
        (second,) = row.more
        assert second.status == STATUS_OK and len(second.class_ids) == user_models.CLASSES, i
        assert len(row.class_ids) == TOP_K and row.embedding is None, i
        assert second.labels == [f"class{c}" for c in second.class_ids], i
        for served, want in ((row, first_ort[i]), (second, second_ort[i])):
            if want.scores[0] - want.scores[1] > DECIDED:
                decided += 1
                assert served.class_ids[0] == want.class_ids[0], i
            worst = max(worst, abs(served.scores[0] - want.scores[0]))
        assert np.linalg.norm(second.embedding) == pytest.approx(1.0, abs=1e-5)  # the spec's normalize: true
        cosines.append(user_models.cosine(second.embedding, second_ort[i].embedding))
    print(f"served set on the CPU: {len(cosines)} photos, {decided} decided top-1 equal, top-1 probability within "
          f"{worst:.1e}, embedding cosine 1 - min = {1 - min(cosines):.1e}")
    assert len(cosines) == len(images) - 2 and decided >= len(cosines)
    assert worst < SCORE_BOUND and min(cosines) > COSINE_BOUND
    assert [r.status for r in got[-2:]] == [STATUS_ERROR, STATUS_ERROR]


def test_one_served_model_answers_its_embedding(models, tmp_path):
    from pipeline.engines.triton import TritonEngine
    from pipeline.triton.repository import build_gpu_repository

    _, user = models
    photos = [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))]
    repo = build_gpu_repository(str(user.onnx_path.parent), tmp_path / "repo", instances=1, batch_size=4,
                                max_batch_size=16, top_k=3)
    with serve_on_cpu(repo) as server:
        engine = TritonEngine(user, url=server.grpc_url, top_k=3, request_batch=4, concurrency=1)
        try:
            got = engine.classify(photos)
        finally:
            engine.close()
    logits, want = user_models.onnx_embeddings(user, photos)
    for i, row in enumerate(got):
        assert row.status == STATUS_OK and row.more == [], (i, row.error)
        assert row.class_ids[0] == int(np.argmax(logits[i])), i
        assert user_models.cosine(row.embedding, want[i]) > COSINE_BOUND, i


def test_the_gpu_repository_is_cached_by_the_set_and_one_models_config_is_unchanged(models, tmp_path):
    from pipeline.triton.checks import check_repository
    from pipeline.triton.configs import GpuModelOptions, gpu_config
    from pipeline.triton.profiles import PROFILES
    from pipeline.triton.repository_cache import cached_repository

    builtin, user = models
    gpu = PROFILES["gpu"]
    one = cached_repository(gpu, builtin, top_k=5, cache_dir=tmp_path)
    pair = cached_repository(gpu, builtin, top_k=5, more=[user], cache_dir=tmp_path)
    assert cached_repository(gpu, builtin, top_k=5, more=[user], cache_dir=tmp_path) == pair
    swapped = cached_repository(gpu, user, top_k=5, more=[builtin], cache_dir=tmp_path)
    assert len({one, pair, swapped}) == 3
    assert check_repository(pair) == [tn.MODEL_NAME]
    version = pair / tn.MODEL_NAME / tn.VERSION
    member = version / tn.SET_FOLDER.format(index=1)
    assert (member / MODEL_FILE).read_bytes() == user.onnx_path.read_bytes()
    assert (member / SPEC_FILE).read_text() == user.spec.to_json()
    assert not (version / MODEL_FILE).exists()  # the built-in model runs from its checkpoint
    config = (pair / tn.MODEL_NAME / "config.pbtxt").read_text()
    assert gpu.set_instances > gpu.instances and f"count: {gpu.set_instances}\n" in config  # a set's own count
    for name, dims in (("CLASS_IDS_1", 5), ("SCORES_1", 5), ("EMBEDDING_1", user_models.EMBEDDING_DIM)):
        assert f'name: "{name}"\n  data_type: {"TYPE_INT32" if "IDS" in name else "TYPE_FP32"}\n  dims: {dims}\n' in config
    assert f'name: "{tn.OUTPUT_EMBEDDING}"' not in config.replace('"EMBEDDING_1"', "")  # the built-in has none
    single = (one / tn.MODEL_NAME / "config.pbtxt").read_text()
    assert f"count: {gpu.instances}\n" in single
    assert single == gpu_config(GpuModelOptions(top_k=5, instances=gpu.instances, max_backlog=gpu.max_backlog))
    assert not (one / tn.MODEL_NAME / tn.VERSION / tn.SET_FOLDER.format(index=1)).exists()


def test_a_served_folder_its_config_does_not_match_is_refused_at_start(models, tmp_path):
    from pipeline.triton.repository import build_gpu_repository
    from pipeline.triton.serve.gpu_model import set_members

    builtin, user = models
    repo = build_gpu_repository(None, tmp_path / "repo", more=[str(user.onnx_path.parent)], top_k=5)
    version = repo / tn.MODEL_NAME / tn.VERSION
    outputs = {tn.OUTPUT_CLASS_IDS: {"dims": ["5"]}, "CLASS_IDS_1": {"dims": ["5"]}, "EMBEDDING_1": {"dims": ["128"]}}
    assert [(m.index, m.top_k, m.spec.embedding is not None) for m in set_members(version, builtin.spec, outputs)] == [
        (0, 5, False), (1, 5, True)]
    with pytest.raises(ValueError, match=r"the config's EMBEDDING_1 is absent but .*model_1/preprocess.json declares "
                                         r"\[128\]; rebuild the repository with bulk-classify"):
        set_members(version, builtin.spec, {k: v for k, v in outputs.items() if k != "EMBEDDING_1"})
    with pytest.raises(ValueError, match=r"model_1 has no CLASS_IDS_1 output in its config; rebuild"):
        set_members(version, builtin.spec, {tn.OUTPUT_CLASS_IDS: {"dims": ["5"]}})


def test_a_repository_without_the_sets_outputs_is_refused_in_the_driver_in_one_line(models, tmp_path, monkeypatch):
    from pipeline.config import RunConfig
    from pipeline.errors import ConfigError
    from pipeline.job import run_job
    from pipeline.triton.repository import build_repository

    builtin, user = models
    folder = str(user.onnx_path.parent)
    production = build_repository("production", folder, str(tmp_path / "production"), artifacts=False)
    out = tmp_path / "out"
    started = []  # the job's Ray start, which the refusal must come before (Ray may run already for other tests)
    monkeypatch.setattr("pipeline.job.stages.init_ray", lambda *a, **k: started.append(1))
    for model, message in (
            (("taxonomy=default", f"colour={folder}"), r"lacks CLASS_IDS_1, SCORES_1, EMBEDDING_1 for a set of 2 "
                                                       r"models; leave repository out .*or run one --model$"),
            (folder, r"lacks EMBEDDING for model '.*'s embedding; leave repository out .* without an embedding$")):
        with pytest.raises(ConfigError, match=r"^--engine-option repository=.* " + message) as err:
            run_job(RunConfig(source=str(PHOTOS), output=str(out), engine="triton", model=model,
                              engine_options={"repository": str(production)}))
        assert "\n" not in str(err.value)
    assert not out.exists() and not started


def test_the_drivers_node_server_serves_the_set(models):
    """``EngineSpec.start_node`` with a set's other models starts the node's shared server for the whole set (the
    portable profile here, the gpu profile's shape on a GPU node), which the actors' own engines then share."""
    from pipeline.engines.registry import engine_spec
    from pipeline.model.imaging import DecodeLimits

    builtin, user = models
    spec = engine_spec("triton")
    options = spec.parse_options({"profile": "portable", "share_server": True})
    node = spec.start_node(builtin, top_k=5, limits=DecodeLimits(), options=options, more=(user,))
    node.close()  # once the start is done: a server without the set's outputs would have left no engine
    (engine,) = node.engines
    assert engine.more == (user,) and engine._top_ks == [5, user_models.CLASSES]
    assert node.events["server_starts"] == 1


def test_the_served_models_cudnn_autotuner_is_its_configs(models, tmp_path):
    """``cudnn_autotune`` reaches the served model through its config.pbtxt (Triton hands the model its JSON); a
    config without it runs the served default."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from pipeline.triton.repository import build_gpu_repository
    from pipeline.triton.serve.gpu_model import SERVED_CUDNN_AUTOTUNE, served_cudnn_autotune

    builtin, user = models
    seen = {}
    for name, given in (("on", True), ("off", False), ("default", None)):
        options = {} if given is None else {"cudnn_autotune": given}
        repo = build_gpu_repository(None, tmp_path / name, more=[str(user.onnx_path.parent)], **options)
        text = (repo / tn.MODEL_NAME / "config.pbtxt").read_text()
        config = json_format.MessageToDict(text_format.Parse(text, model_config_pb2.ModelConfig()),
                                           preserving_proto_field_name=True)
        seen[name] = served_cudnn_autotune(config)
        assert (tn.GPU_PARAM_CUDNN_AUTOTUNE in config["parameters"]) == (given is not None)
    assert seen == {"on": True, "off": False, "default": SERVED_CUDNN_AUTOTUNE}
